"""Inventory reservations fenced by per-SKU leases: the domain over :mod:`fencing`.

Every stock change takes the SKU's current :class:`fencing.Lease` and an idempotency key; the stock row
refuses stale tokens in the same statement as the change, and a key is applied at most once.
"""

from reservations.audit import Rule, Violation
from reservations.counting import StockSeen
from reservations.errors import (
    CountBelowHeld,
    IdempotencyConflict,
    InsufficientStock,
    InvalidRequest,
    InvalidTransition,
    RequestClosed,
    ReservationError,
    SeenInAnotherEpoch,
    StockLimitExceeded,
    UnknownReservation,
    UnknownSku,
)
from reservations.inventory import DEFAULT_IDEMPOTENCY_RETENTION, AsyncInventory, Inventory, lock_order
from reservations.validation import MAX_ON_HAND, scope_of
from reservations.views import HistoryEntry, Outcome, ReservationView, StockLevel

__all__ = [
    "DEFAULT_IDEMPOTENCY_RETENTION",
    "MAX_ON_HAND",
    "AsyncInventory",
    "CountBelowHeld",
    "HistoryEntry",
    "IdempotencyConflict",
    "InsufficientStock",
    "InvalidRequest",
    "InvalidTransition",
    "Inventory",
    "Outcome",
    "RequestClosed",
    "ReservationError",
    "ReservationView",
    "Rule",
    "SeenInAnotherEpoch",
    "StockLevel",
    "StockLimitExceeded",
    "StockSeen",
    "UnknownReservation",
    "UnknownSku",
    "Violation",
    "lock_order",
    "scope_of",
]
