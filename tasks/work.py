"""What each request message does: the SKUs whose leases it takes and the fenced write it makes under them.

Two kinds, one type each (:data:`Work`):

- :class:`Reserve`, a single-SKU reservation: one statement writes its change, its attempt and its
  outcome (on PostgreSQL), and answers a request that already ended too; a busy lease's holder can serve
  it in a batch (:class:`tasks.serving.Batchable`).
- every other request (:class:`Fenced`): the attempt takes its leases, makes the write it decides, then
  records the attempt and the outcome. A count or a replenishment reads under its leases first and
  decides its write from the read (the read comes before the ``before_write`` failpoint, the write
  after it); the others decide nothing.
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
# The write a request makes under its leases, decided (for a count, a replenishment) from a read.
Write = Callable[[Inventory, Leases], Outcome]


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
    """A request whose attempt and outcome the task records after its write."""

    def skus(self, inv: Inventory) -> list[str]: ...

    def decide(self, inv: Inventory, leases: Leases) -> Write:
        """The write to make, read for and decided now (under the leases)."""
        ...


@dataclass(frozen=True)
class ReserveOrder:
    lines: list[tuple[str, int]]
    hold_for: float | None
    key: str

    def skus(self, inv: Inventory) -> list[str]:
        return [sku for sku, _ in self.lines]

    def decide(self, inv: Inventory, leases: Leases) -> Write:
        return lambda inv, leases: inv.reserve_many(leases, self.lines, key=self.key, hold_for=self.hold_for)


@dataclass(frozen=True)
class Restock:
    sku: str
    quantity: int
    key: str

    def skus(self, inv: Inventory) -> list[str]:
        return [self.sku]

    def decide(self, inv: Inventory, leases: Leases) -> Write:
        return lambda inv, leases: inv.restock(leases[self.sku], self.sku, self.quantity, key=self.key)


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

    def decide(self, inv: Inventory, leases: Leases) -> Write:
        sku, shrinkage = self.sku, self.shrinkage
        seen = inv.look(leases[sku], sku)
        figure = counted_units(self.counted) if shrinkage is None else short_count(seen, shrinkage)
        return lambda inv, leases: inv.count(
            leases[sku], sku, figure, key=self.key, seen=seen, shrinkage=shrinkage
        )


@dataclass(frozen=True)
class Replenish:
    """Books par minus the on hand read now."""

    sku: str
    par: int
    key: str

    def skus(self, inv: Inventory) -> list[str]:
        return [self.sku]

    def decide(self, inv: Inventory, leases: Leases) -> Write:
        seen = inv.look(leases[self.sku], self.sku)
        return lambda inv, leases: inv.replenish(
            leases[self.sku], self.sku, self.par, key=self.key, seen=seen
        )


@dataclass(frozen=True)
class Finish:
    """A confirm or a release of a reservation, under the lease of the reservation's SKU."""

    operation: str  # "confirm" or "release"
    reservation_id: str
    key: str

    def skus(self, inv: Inventory) -> list[str]:
        return [inv.reservation(self.reservation_id).sku]

    def decide(self, inv: Inventory, leases: Leases) -> Write:
        return self._write

    def _write(self, inv: Inventory, leases: Leases) -> Outcome:
        (lease,) = leases.values()
        finish = inv.confirm if self.operation == "confirm" else inv.release
        return finish(lease, self.reservation_id, key=self.key)


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
