"""What each request message does: the SKUs whose leases it takes, the fenced operation it runs under
them (for a count or a replenishment, decided from what it reads under them first), and for a single-SKU
reservation how a busy lease's holder can serve it instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fencing import Lease
from reservations import Inventory, Outcome
from reservations.counting import counted_units, short_count
from reservations.messages import Message
from reservations.requests import RequestReply
from tasks.serving import Batchable
from tasks.worker import Resources

Apply = Callable[[Inventory, dict[str, Lease]], Outcome]
Run = Callable[[Inventory, dict[str, Lease], dict[str, Any], int], RequestReply]
# A request whose write is decided from a read: reads under the leases, returns the write it decided.
Decide = Callable[[Inventory, dict[str, Lease]], Apply]


@dataclass(frozen=True)
class Work:
    """What a checked message does: the SKUs whose leases it takes, the fenced operation under them, and
    (for a single-SKU reservation) how a busy lease's holder can serve it instead."""

    skus: Callable[[Resources], list[str]]
    apply: Apply
    batch: Batchable | None = None
    # A request whose run also writes its own attempt and outcome (one statement on PostgreSQL); it
    # answers a request that already ended too, so no separate look at the outcome comes first.
    run: Run | None = None
    # A request that reads under its leases first and writes what it decided from the read (a count, a
    # replenishment): the read comes before the ``before_write`` failpoint, the write after it.
    decide: Decide | None = None

    def decided(self, inv: Inventory, leases: dict[str, Lease]) -> Apply:
        """The write to make: read and decided now, for a request that decides from a read."""
        return self.apply if self.decide is None else self.decide(inv, leases)


def _count(sku: str, counted: int | None, shrinkage: int | None, key: str) -> Decide:
    def decide(inv: Inventory, leases: dict[str, Lease]) -> Apply:
        seen = inv.look(leases[sku], sku)
        # Sent as a figure, or as shrinkage from the figure read now (the message has one of the two).
        figure = counted_units(counted) if shrinkage is None else short_count(seen, shrinkage)
        return lambda inv, leases: inv.count(
            leases[sku], sku, figure, key=key, seen=seen, shrinkage=shrinkage
        )

    return decide


def _replenish(sku: str, par: int, key: str) -> Decide:
    def decide(inv: Inventory, leases: dict[str, Lease]) -> Apply:
        seen = inv.look(leases[sku], sku)
        return lambda inv, leases: inv.replenish(leases[sku], sku, par, key=key, seen=seen)

    return decide


def _decided(sku: str, decide: Decide) -> Work:
    return Work(lambda _: [sku], lambda inv, leases: decide(inv, leases)(inv, leases), decide=decide)


def work_of(message: Message) -> Work:
    args, key = message.args, message.key
    if message.name == "reserve":
        sku, quantity, hold_for = args["sku"], args["quantity"], args["hold_for"]
        return Work(
            lambda _: [sku],
            lambda inv, leases: inv.reserve(leases[sku], sku, quantity, key=key, hold_for=hold_for),
            Batchable(sku, quantity, hold_for),
            lambda inv, leases, who, epochs: inv.reserve_request(
                leases[sku], sku, quantity, key=key, hold_for=hold_for, epochs=epochs, **who
            ),
        )
    if message.name == "reserve_order":
        lines = args["lines"]
        return Work(
            lambda _: [sku for sku, _ in lines],
            lambda inv, leases: inv.reserve_many(leases, lines, key=key, hold_for=args["hold_for"]),
        )
    if message.name == "restock":
        sku, quantity = args["sku"], args["quantity"]
        return Work(lambda _: [sku], lambda inv, leases: inv.restock(leases[sku], sku, quantity, key=key))
    if message.name == "count":
        return _decided(args["sku"], _count(args["sku"], args["counted"], args["shrinkage"], key))
    if message.name == "replenish":
        return _decided(args["sku"], _replenish(args["sku"], args["par"], key))
    reservation_id = args["reservation_id"]

    def apply(inv: Inventory, leases: dict[str, Lease]) -> Outcome:
        (lease,) = leases.values()
        finish = inv.confirm if message.name == "confirm" else inv.release
        return finish(lease, reservation_id, key=key)

    return Work(lambda res: [res.inventory.reservation(reservation_id).sku], apply)
