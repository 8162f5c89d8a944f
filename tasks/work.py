"""What each request message does: the SKUs whose leases it takes, the fenced operation it runs under
them, and for a single-SKU reservation how a busy lease's holder can serve it instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fencing import Lease
from reservations import Inventory, Outcome
from reservations.messages import Message
from reservations.requests import RequestReply
from tasks.serving import Batchable
from tasks.worker import Resources

Apply = Callable[[Inventory, dict[str, Lease]], Outcome]
Run = Callable[[Inventory, dict[str, Lease], dict[str, Any], int], RequestReply]
















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
    reservation_id = args["reservation_id"]

    def apply(inv: Inventory, leases: dict[str, Lease]) -> Outcome:
        (lease,) = leases.values()
        finish = inv.confirm if message.name == "confirm" else inv.release
        return finish(lease, reservation_id, key=key)

    return Work(lambda res: [res.inventory.reservation(reservation_id).sku], apply)
