"""The retry and terminal policy of a request task, in one table: which error leads to which action.

==============================  =======================================================================
error in an attempt             action
==============================  =======================================================================
malformed message               final ``invalid`` (recorded under its key when it has one)
taken up past its deadline      final ``expired``, before any lease or stock is touched (tasks.deadlines)
InvalidRequest, UnknownSku,     final ``invalid``: it can never succeed
UnknownReservation,
InvalidTransition,
IdempotencyConflict,
RequestClosed,
InvalidLeaseRequest
InsufficientStock               final ``insufficient_stock``
LeaseBusy                       single-SKU reserve: queue for the holder (hot-SKU protocol, tasks.serving);
                                else retry with jittered backoff, ``busy`` counter; final
                                ``dead_lettered`` after ``max_retries``
LostOwnership (StaleToken,      attempt recorded ``lost_ownership``, its lease is done; the request runs
LeaseLost; also a database      again in a new epoch (a new lease, a new token), ``epoch`` counter;
error after the lease ran out)  final ``dead_lettered`` after ``max_epochs``
BackendUnavailable              retry with backoff growing to 30 s, ``transient`` counter; final
                                ``dead_lettered`` after ``max_transient_retries``
anything else (a bug)           final ``dead_lettered`` ("unexpected error"), then re-raised
==============================  =======================================================================

Each counter travels with the message, so one kind of retry never uses up another's budget.
"""

from __future__ import annotations

import random
from typing import Any

from fencing import BackendUnavailable, InvalidLeaseRequest, Lease, LeaseLost
from fencing.manager import backoff
from reservations import (
    IdempotencyConflict,
    InvalidRequest,
    InvalidTransition,
    RequestClosed,
    UnknownReservation,
    UnknownSku,
)

# Errors that end a request ``invalid``: no retry can make it succeed.
INVALID = (
    RequestClosed,
    InvalidRequest,
    UnknownSku,
    UnknownReservation,
    InvalidTransition,
    IdempotencyConflict,
    InvalidLeaseRequest,
)

rng = random.Random()


def counter(kwargs: dict[str, Any], name: str) -> int:
    value = kwargs.get(name, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def jitter(retry_after: float, attempt: int) -> float:
    """Backoff between task retries: the lease backoff with a broker round trip's larger steps."""
    return backoff(attempt, retry_after, rng, first=0.01, cap=1.0, floor=0.005)


def lost_with_the_lease(leases: dict[str, Lease], exc: BackendUnavailable) -> LeaseLost | None:
    """A database error after the lease ran out is lost ownership, not a passing outage: the database
    ends a transaction left idle past the lease ttl (a frozen or cut-off worker), so the rows it locked
    go to the next holder instead of waiting for the pause to end."""
    for lease in leases.values():
        if lease.lost or lease.time_left() <= 0:
            return LeaseLost(
                scope=lease.scope,
                token=lease.token,
                lease_id=lease.lease_id,
                reason=f"the database ended the transaction after the lease ran out: {exc}",
            )
    return None


def printable(error: BaseException, limit: int = 500) -> str:
    """An error as stored free text: a database's message may carry newlines or tabs, which the attempt
    log refuses (it is printed by the CLI)."""
    return "".join(ch if ch.isprintable() else " " for ch in str(error))[:limit]
