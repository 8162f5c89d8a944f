"""The status vocabularies, each written once: a reservation's state, a request's final outcome, and what
one attempt at a request did. They are StrEnums, so they are stored and sent as their plain strings.
"""

from __future__ import annotations

from enum import StrEnum


class ReservationStatus(StrEnum):
    """A reservation row's state; only ``HELD`` counts in ``stock.reserved``, the others are final."""

    HELD = "held"
    CONFIRMED = "confirmed"
    RELEASED = "released"
    EXPIRED = "expired"


class RequestStatus(StrEnum):
    """A request's one final outcome, as its waiter reads it."""

    RESERVED = "reserved"
    CONFIRMED = "confirmed"
    RELEASED = "released"
    RESTOCKED = "restocked"
    ADJUSTED = "adjusted"
    COUNTED = "counted"
    REPLENISHED = "replenished"
    INSUFFICIENT_STOCK = "insufficient_stock"
    INVALID = "invalid"
    DEAD_LETTERED = "dead_lettered"
    # Taken up after the deadline its sender gave: ended without touching stock or taking a lease.
    EXPIRED = "expired"
    # Ended by an operator before any worker carried it out (reservations.acceptance.cancel).
    CANCELLED = "cancelled"


class AttemptResult(StrEnum):
    """What one attempt (one task run) at a request did; a request may take several."""

    APPLIED = "applied"
    REPLAYED = "replayed"
    LOST_OWNERSHIP = "lost_ownership"
    BUSY = "busy"
    TRANSIENT = "transient"
    INSUFFICIENT_STOCK = "insufficient_stock"
    INVALID = "invalid"
    DEAD_LETTERED = "dead_lettered"
    EXPIRED = "expired"


# The status a request that succeeded ends in, per operation.
SUCCEEDED = {
    "reserve": RequestStatus.RESERVED,
    "reserve_many": RequestStatus.RESERVED,
    "confirm": RequestStatus.CONFIRMED,
    "release": RequestStatus.RELEASED,
    "restock": RequestStatus.RESTOCKED,
    "adjust": RequestStatus.ADJUSTED,
    "count": RequestStatus.COUNTED,
    "replenish": RequestStatus.REPLENISHED,
}
