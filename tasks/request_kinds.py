"""What each request message does: the SKUs whose leases it takes and the fenced write it makes under them.

Every kind (:data:`Work`) names its SKUs and, under their leases, decides its write: a count or a
replenishment reads first and decides its write from the read (the read comes before the
``before_write`` failpoint, the write after it); the others decide nothing. The write is handed back
bound to its arguments (:func:`functools.partial`), so that the attempt calls the inventory itself.

A single-SKU reservation, a confirm, a release, a restock, a count and a replenishment are written as
requests: one statement on PostgreSQL with their attempt and outcome, answering a request that already
ended. A reservation's busy lease can have its holder serve it in a batch (:class:`tasks.hot_sku.Batchable`).
An order's write is an operation, whose attempt and outcome the task records after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from fencing import Lease
from reservations import Inventory, Outcome
from reservations.counting import counted_units, short_count
from reservations.request_outcomes import RequestReply
from tasks.hot_sku import Batchable
from tasks.messages import Message

Leases = dict[str, Lease]
# Who a request's write speaks for: the task id and the worker (tasks.worker.worker_identity).
Who = dict[str, Any]
# The write a request makes under its leases, bound to its arguments: the request run to its outcome,
# or (an order) the operation whose outcome the task then records.
Write = Callable[[], RequestReply | Outcome]


class Work:
    """A request kind; by default one that writes one SKU, ``sku``, as a request run to its outcome."""

    sku: str
    # Whether its write answers a request that already ended (as a request run to its outcome does), so
    # the task need not look for the outcome before taking the leases.
    answers_ended = True

    @property
    def batch(self) -> Batchable | None:
        """What the holder of its busy lease serves for it; None where nobody can (all but a reservation)."""
        return None

    def skus(self, inv: Inventory) -> list[str]:
        return [self.sku]

    def decide(self, inv: Inventory, leases: Leases, who: Who, epochs: int) -> Write:
        """The write to make, read for and decided now (under the leases)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Reserve(Work):
    """A single-SKU reservation, written with its attempt and outcome in one statement."""

    sku: str
    quantity: int
    hold_for: float | None
    key: str

    @property
    def batch(self) -> Batchable:
        return Batchable(self.sku, self.quantity, self.hold_for)

    def decide(self, inv: Inventory, leases: Leases, who: Who, epochs: int) -> Write:
        return partial(
            inv.reserve_request, leases[self.sku], self.sku, self.quantity,
            key=self.key, hold_for=self.hold_for, epochs=epochs, **who,
        )  # fmt: skip


@dataclass(frozen=True)
class ReserveOrder(Work):
    lines: list[tuple[str, int]]
    hold_for: float | None
    key: str
    answers_ended = False

    def skus(self, inv: Inventory) -> list[str]:
        return [sku for sku, _ in self.lines]

    def decide(self, inv: Inventory, leases: Leases, who: Who, epochs: int) -> Write:
        return partial(inv.reserve_many, leases, self.lines, key=self.key, hold_for=self.hold_for)


@dataclass(frozen=True)
class Restock(Work):
    sku: str
    quantity: int
    key: str

    def decide(self, inv: Inventory, leases: Leases, who: Who, epochs: int) -> Write:
        return partial(
            inv.restock_request, leases[self.sku], self.sku, self.quantity, key=self.key, epochs=epochs, **who
        )


@dataclass(frozen=True)
class Count(Work):
    """Sets on hand to the figure sent, or to the figure read now less the shrinkage sent (the message
    has one of the two)."""

    sku: str
    counted: int | None
    shrinkage: int | None
    key: str

    def decide(self, inv: Inventory, leases: Leases, who: Who, epochs: int) -> Write:
        sku, shrinkage = self.sku, self.shrinkage
        seen = inv.look(leases[sku], sku)
        figure = counted_units(self.counted) if shrinkage is None else short_count(seen, shrinkage)
        return partial(
            inv.count_request, leases[sku], sku, figure,
            key=self.key, seen=seen, shrinkage=shrinkage, epochs=epochs, **who,
        )  # fmt: skip


@dataclass(frozen=True)
class Replenish(Work):
    """Books par minus the on hand read now."""

    sku: str
    par: int
    key: str

    def decide(self, inv: Inventory, leases: Leases, who: Who, epochs: int) -> Write:
        seen = inv.look(leases[self.sku], self.sku)
        return partial(
            inv.replenish_request, leases[self.sku], self.sku, self.par,
            key=self.key, seen=seen, epochs=epochs, **who,
        )  # fmt: skip


@dataclass(frozen=True)
class Finish(Work):
    """A confirm or a release of a reservation, under the lease of the reservation's SKU."""

    operation: str  # "confirm" or "release"
    reservation_id: str
    key: str

    def skus(self, inv: Inventory) -> list[str]:
        return [inv.reservation(self.reservation_id).sku]

    def decide(self, inv: Inventory, leases: Leases, who: Who, epochs: int) -> Write:
        (lease,) = leases.values()
        finish = inv.confirm_request if self.operation == "confirm" else inv.release_request
        return partial(finish, lease, self.reservation_id, key=self.key, epochs=epochs, **who)


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
