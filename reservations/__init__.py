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
    StockLimitExceeded,
    UnknownReservation,
    UnknownSku,
)
from reservations.inventory import DEFAULT_IDEMPOTENCY_RETENTION, AsyncInventory, Inventory
from reservations.validation import scope_of
from reservations.values import Outcome, StockLevel

__all__ = [
    "DEFAULT_IDEMPOTENCY_RETENTION",
    "AsyncInventory",
    "IdempotencyConflict",
    "InsufficientStock",
    "InvalidRequest",
    "InvalidTransition",
    "Inventory",
    "Outcome",
    "RequestClosed",
    "ReservationError",
    "StockLevel",
    "StockLimitExceeded",
    "UnknownReservation",
    "UnknownSku",
    "scope_of",
]
