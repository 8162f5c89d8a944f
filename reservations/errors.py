"""Errors of the inventory domain, one tree under :class:`ReservationError`.

::

    ReservationError
    ├── InvalidRequest          malformed SKU, quantity, key, lease, text...; nothing written (a ValueError)
    │   ├── RedriveRefused      a request that may not be driven again now (key, why): not dead-lettered,
    │   │                       no recorded arguments, a re-drive still running or already ended
    │   ├── StockLimitExceeded  the change would take on_hand past MAX_ON_HAND (sku, on_hand, delta, limit)
    │   ├── CountBelowHeld      a count below the units held for reservations (sku, counted, held)
    │   └── SeenInAnotherEpoch  a count or replenishment decided from a read under another token than
    │                           its writing lease's (sku, seen_token, token)
    ├── UnknownSku              no stock row for the SKU
    ├── UnknownReservation      no reservation with that id or key
    ├── UnknownRequest          no request has an outcome under that key (never sent, running, purged)
    ├── InvalidTransition       confirm/release of a reservation that is final or belongs to another SKU
    ├── InsufficientStock       available < requested (sku, requested, available)
    ├── IdempotencyConflict     the key was used before for a different request
    ├── RequestClosed           the key's request already ended without effect (invalid, dead-lettered)
    ├── KeyTaken                a row under the request's key exists already: a concurrent copy of the
    │                           request committed first (where: reservation, record, outcome, pending,
    │                           redrive)
    ├── ConstraintRefused       the database refused a write that would break a rule (constraint, rule):
    │                           a bug or a foreign writer, never retried
    ├── ArchiveInterrupted      an archive run stopped at a span (partition, why) with nothing of it lost:
    │                           its rows stay in the database (or its detached table); run it again
    └── ArchiveBusy             another archive run of the same database holds its lock

Database integrity errors become the last two in one place, :mod:`reservations.constraints`, by constraint
name.

Fencing errors (``StaleToken``, ``LeaseLost``, ``BackendUnavailable``, ...) pass through unchanged: they
are about ownership and reachability, not about the inventory.
"""

from __future__ import annotations

from typing import Any


class ReservationError(Exception):
    """Base of every inventory error. ``replayed`` is True when it is the stored outcome of a key."""

    replayed: bool = False


class InvalidRequest(ReservationError, ValueError):
    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        super().__init__(message)


class StockLimitExceeded(InvalidRequest):
    def __init__(self, *, sku: str, on_hand: int, delta: int, limit: int) -> None:
        self.sku = sku
        self.on_hand = on_hand
        self.delta = delta
        self.limit = limit
        message = f"SKU {sku!r}: on hand {on_hand} + {delta} would pass the limit of {limit} units"
        super().__init__(message, field="quantity")


class CountBelowHeld(InvalidRequest):
    """The shelf cannot hold fewer units than are promised: refused in the write itself."""

    def __init__(self, *, sku: str, counted: int, held: int) -> None:
        self.sku = sku
        self.counted = counted
        self.held = held
        super().__init__(f"SKU {sku!r}: counted {counted}, but {held} units are held", field="counted")


class SeenInAnotherEpoch(InvalidRequest):
    """A count or a replenishment whose ``seen`` was read under another token than the lease it writes
    under. The fence keeps older epochs from writing after that read, but not a newer holder from deciding
    from it: stock another epoch wrote since would be overwritten or ordered on top of. Nothing is written."""

    def __init__(self, *, sku: str, seen_token: int, token: int) -> None:
        self.sku = sku
        self.seen_token = seen_token
        self.token = token
        message = (
            f"SKU {sku!r}: seen was read under token {seen_token}, but the write's lease holds token {token};"
            " read the stock again under this lease"
        )
        super().__init__(message, field="seen")


class RedriveRefused(InvalidRequest):
    def __init__(self, *, key: str, why: str) -> None:
        self.key = key
        self.why = why
        super().__init__(f"cannot re-drive {key!r}: {why}", field="key")


class UnknownSku(ReservationError, LookupError):
    def __init__(self, sku: str) -> None:
        self.sku = sku
        super().__init__(f"unknown SKU {sku!r}")


class UnknownReservation(ReservationError, LookupError):
    def __init__(self, reservation: str) -> None:
        self.reservation = reservation
        super().__init__(f"unknown reservation {reservation!r}")


class UnknownRequest(ReservationError, LookupError):
    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"no request with an outcome under key {key!r}")


class InvalidTransition(ReservationError):
    """``belongs_to``: the reservation's SKU, when the refusal is that it is not the lease's."""

    def __init__(
        self,
        *,
        reservation_id: str,
        status: str,
        operation: str,
        detail: str = "",
        belongs_to: str | None = None,
    ) -> None:
        self.reservation_id = reservation_id
        self.status = status
        self.operation = operation
        self.belongs_to = belongs_to
        suffix = f": {detail}" if detail else ""
        super().__init__(f"cannot {operation} reservation {reservation_id} (status {status}){suffix}")


class InsufficientStock(ReservationError):
    def __init__(self, *, sku: str, requested: int, available: int) -> None:
        self.sku = sku
        self.requested = requested
        self.available = available
        super().__init__(f"SKU {sku!r}: requested {requested}, available {available}")

    def summary(self) -> dict[str, Any]:
        """The detail of the request's final ``insufficient_stock`` outcome."""
        return {"sku": self.sku, "requested": self.requested, "available": self.available}


class IdempotencyConflict(ReservationError):
    def __init__(self, *, key: str, operation: str, stored_operation: str) -> None:
        self.key = key
        self.operation = operation
        self.stored_operation = stored_operation
        super().__init__(
            f"idempotency key {key!r} was used for a different request ({stored_operation}); "
            f"refusing {operation}"
        )


class RequestClosed(ReservationError):
    def __init__(self, *, key: str, status: str) -> None:
        self.key = key
        self.status = status
        super().__init__(f"request {key!r} already ended as {status}; it cannot take effect now")


class KeyTaken(ReservationError):
    def __init__(self, *, where: str, constraint: str) -> None:
        self.where = where
        self.constraint = constraint
        super().__init__(f"the request's {where} row exists already ({constraint})")


class ConstraintRefused(ReservationError):
    """The database refused a write by a CHECK constraint or a trigger. ``rule`` names the audit's rule
    (:class:`reservations.audit.Rule`) the constraint states, when it states one."""

    def __init__(self, *, constraint: str | None, rule: str | None, detail: str) -> None:
        self.constraint = constraint
        self.rule = rule
        self.detail = detail
        super().__init__(f"the database refused the write ({constraint or 'trigger'}): {detail}")


class ArchiveInterrupted(ReservationError):
    def __init__(self, partition: str, why: str) -> None:
        self.partition = partition
        self.why = why
        super().__init__(f"archiving {partition} stopped: {why}")


class ArchiveBusy(ReservationError):
    """Two runs would copy and drop the same days (reservations.archive)."""

    def __init__(self, where: str) -> None:
        self.where = where
        super().__init__(f"another archive run of {where} is under way (it holds the archive lock)")
