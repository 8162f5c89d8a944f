"""What each request message does: the SKUs whose leases it takes and the fenced write it makes under them.

Two kinds (:data:`Work`):

- :class:`Reserve`, a single-SKU reservation: one statement writes its change, its attempt and its
  outcome (on PostgreSQL), and answers a request that already ended too; a busy lease's holder can serve
  it in a batch (:class:`tasks.serving.Batchable`).
- every other request (:class:`Fenced`): the attempt takes its leases and makes the write it decides. A
  count or a replenishment reads under its leases first and decides its write from the read (the read
  comes before the ``before_write`` failpoint, the write after it); the others decide nothing. A
  confirm, a release, a restock, a count and a replenishment are written as requests (one statement on
  PostgreSQL with their attempt and outcome, answering a request that already ended, as a reservation
  is); an order's write is an operation, whose attempt and outcome the task records after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fencing import Lease
from reservations import Inventory, Outcome
from reservations.counting import counted_units, short_count
from reservations.requests import RequestReply
from tasks.messages import Message
from tasks.serving import Batchable

Leases = dict[str, Lease]
# Who a request's write speaks for: the task id and the worker (tasks.worker.worker_identity).
Who = dict[str, Any]
# The write a request makes under its leases, decided (for a count, a replenishment) from a read: the
# request run to its outcome, or (an order) the operation whose outcome the task then records.
Write = Callable[[Inventory, Leases], RequestReply | Outcome]


@dataclass(frozen=True)
class Reserve:
    """A single-SKU reservation, written with its attempt and outcome in one statement."""

    sku: str
    quantity: int
    hold_for: float | None
    key: str

    def skus(self, inv: Inventory) -> list[str]:
        return [self.sku]

    @property
    def batch(self) -> Batchable:
        """What the holder of its busy lease serves for it."""
        return Batchable(self.sku, self.quantity, self.hold_for)

    def run(self, inv: Inventory, leases: Leases, who: dict[str, Any], epochs: int) -> RequestReply:
        return inv.reserve_request(
            leases[self.sku],
            self.sku,
            self.quantity,
            key=self.key,
            hold_for=self.hold_for,
            epochs=epochs,
            **who,
        )


class Fenced(Protocol):
    """A request other than a single-SKU reservation."""

    # Whether its write answers a request that already ended (as a request run to its outcome does), so
    # the task need not look for the outcome before taking the leases.
    answers_ended: bool

    def skus(self, inv: Inventory) -> list[str]: ...

    def decide(self, inv: Inventory, leases: Leases, who: Who, epochs: int) -> Write:
        """The write to make, read for and decided now (under the leases)."""
        ...


@dataclass(frozen=True)
class ReserveOrder:
    lines: list[tuple[str, int]]
    hold_for: float | None
    key: str

    def skus(self, inv: Inventory) -> list[str]:
        return [sku for sku, _ in self.lines]

    answers_ended = False

    def decide(self, inv: Inventory, leases: Leases, who: Who, epochs: int) -> Write:
        return lambda inv, leases: inv.reserve_many(leases, self.lines, key=self.key, hold_for=self.hold_for)


@dataclass(frozen=True)
class Restock:
    sku: str
    quantity: int
    key: str

    def skus(self, inv: Inventory) -> list[str]:
        return [self.sku]

    answers_ended = True

    def decide(self, inv: Inventory, leases: Leases, who: Who, epochs: int) -> Write:
        return lambda inv, leases: inv.restock_request(
            leases[self.sku], self.sku, self.quantity, key=self.key, epochs=epochs, **who
        )


@dataclass(frozen=True)
class Count:
    """Sets on hand to the figure sent, or to the figure read now less the shrinkage sent (the message
    has one of the two)."""

    sku: str
    counted: int | None
    shrinkage: int | None
    key: str

    def skus(self, inv: Inventory) -> list[str]:
        return [self.sku]

    answers_ended = True

    def decide(self, inv: Inventory, leases: Leases, who: Who, epochs: int) -> Write:
        sku, shrinkage = self.sku, self.shrinkage
        seen = inv.look(leases[sku], sku)
        figure = counted_units(self.counted) if shrinkage is None else short_count(seen, shrinkage)
        return lambda inv, leases: inv.count_request(
            leases[sku], sku, figure, key=self.key, seen=seen, shrinkage=shrinkage, epochs=epochs, **who
        )


@dataclass(frozen=True)
class Replenish:
    """Books par minus the on hand read now."""

    sku: str
    par: int
    key: str

    def skus(self, inv: Inventory) -> list[str]:
        return [self.sku]

    answers_ended = True

    def decide(self, inv: Inventory, leases: Leases, who: Who, epochs: int) -> Write:
        seen = inv.look(leases[self.sku], self.sku)
        return lambda inv, leases: inv.replenish_request(
            leases[self.sku], self.sku, self.par, key=self.key, seen=seen, epochs=epochs, **who
        )


@dataclass(frozen=True)
class Finish:
    """A confirm or a release of a reservation, under the lease of the reservation's SKU."""

    operation: str  # "confirm" or "release"
    reservation_id: str
    key: str

    def skus(self, inv: Inventory) -> list[str]:
        return [inv.reservation(self.reservation_id).sku]

    answers_ended = True

    def decide(self, inv: Inventory, leases: Leases, who: Who, epochs: int) -> Write:
        def write(inv: Inventory, leases: Leases) -> RequestReply:
            (lease,) = leases.values()
            finish = inv.confirm_request if self.operation == "confirm" else inv.release_request
            return finish(lease, self.reservation_id, key=self.key, epochs=epochs, **who)

        return write


Work = Reserve | Fenced


def work_of(message: Message) -> Work:
    args, key = message.args, message.key
    if message.name == "reserve":
        return Reserve(args["sku"], args["quantity"], args["hold_for"], key)
    if message.name == "reserve_order":
        return ReserveOrder(args["lines"], args["hold_for"], key)
    if message.name == "restock":
        return Restock(args["sku"], args["quantity"], key)
    if message.name == "count":
        return Count(args["sku"], args["counted"], args["shrinkage"], key)
    if message.name == "replenish":
        return Replenish(args["sku"], args["par"], key)
    return Finish(message.name, args["reservation_id"], key)
