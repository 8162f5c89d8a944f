"""Inventory reservations fenced by per-SKU leases: the domain over :mod:`fencing`.

Every stock change takes the SKU's current :class:`fencing.Lease` and an idempotency key; the stock row
refuses stale tokens in the same statement as the change, and a key is applied at most once.
"""

from reservations.errors import (
    IdempotencyConflict,
    InsufficientStock,
    InvalidRequest,
    InvalidTransition,
    RequestClosed,
    ReservationError,
    UnknownReservation,
    UnknownSku,
)
from reservations.inventory import DEFAULT_IDEMPOTENCY_RETENTION, AsyncInventory, Inventory, lock_order
from reservations.validation import scope_of
from reservations.views import HistoryEntry, Outcome, ReservationView, StockLevel

__all__ = [
    "DEFAULT_IDEMPOTENCY_RETENTION",
    "AsyncInventory",
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
    "StockLevel",
    "UnknownReservation",
    "UnknownSku",
    "lock_order",
    "scope_of",
]
