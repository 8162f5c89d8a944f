"""The retry and terminal policy of a request task: which error leads to which action, decided by
:func:`decide` without I/O (the table below is its specification, row by row in tests/test_policy.py);
:class:`tasks.attempt.Attempt` does the I/O each decision needs.

==============================  =======================================================================
error in an attempt             action
==============================  =======================================================================
malformed message               final ``invalid`` (recorded under its key when it has one;
                                tasks.request_tasks, before any attempt)
taken up past its deadline      final ``expired``, before any lease or stock is touched (tasks.messages.late)
InvalidRequest, UnknownSku,     final ``invalid``: it can never succeed
UnknownReservation,
InvalidTransition,
IdempotencyConflict,
RequestClosed,
InvalidLeaseRequest
InsufficientStock               final ``insufficient_stock``
LeaseBusy                       single-SKU reserve: queue for the holder (hot-SKU protocol, tasks.hot_sku);
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

from collections.abc import Mapping
from dataclasses import dataclass
from random import Random
from typing import Any

from fencing import BackendUnavailable, InvalidLeaseRequest, Lease, LeaseBusy, LeaseLost, LostOwnership
from fencing.manager import backoff
from reservations import (
    IdempotencyConflict,
    InsufficientStock,
    InvalidRequest,
    InvalidTransition,
    RequestClosed,
    UnknownReservation,
    UnknownSku,
)
from reservations.statuses import RequestStatus
from tasks.settings import Settings

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

rng = Random()
# The longest pause between transient retries: a database restart or a Redis failover takes that long.
TRANSIENT_CEILING = 30.0


@dataclass(frozen=True)
class Limits:
    """The budgets of the three counters (RESERVATIONS_MAX_RETRIES, _MAX_EPOCHS, _MAX_TRANSIENT_RETRIES)."""

    busy: int
    epochs: int
    transient: int

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        return cls(settings.max_retries, settings.max_epochs, settings.max_transient_retries)


@dataclass(frozen=True)
class Final:
    """The request ends with this outcome; a dead letter's ``detail`` starts with its ``reason``."""

    status: str
    detail: dict[str, Any]


@dataclass(frozen=True)
class Again:
    """The request is retried after ``delay`` seconds with ``counter`` raised by one."""

    counter: str
    delay: float


@dataclass(frozen=True)
class HandOff:
    """The request waits in its SKU's queue for the lease holder to serve it (tasks.hot_sku)."""


Decision = Final | Again | HandOff


def decide(
    error: BaseException,
    counts: Mapping[str, int],
    limits: Limits,
    *,
    can_wait: bool = False,
    draw: Random = rng,
) -> Decision:
    """What ``error``, met by an attempt whose message carries ``counts``, leads to. ``can_wait``: a
    single-SKU reservation with batching on, which queues for a busy lease's holder."""
    if isinstance(error, InsufficientStock):
        return Final(RequestStatus.INSUFFICIENT_STOCK, error.summary())
    if isinstance(error, INVALID):
        return Final(RequestStatus.INVALID, {"error": type(error).__name__, "message": str(error)})
    if isinstance(error, LeaseBusy):
        busy = counts.get("busy", 0)
        if can_wait:
            return HandOff()
        if busy >= limits.busy:
            return Final(RequestStatus.DEAD_LETTERED, {"reason": "lease busy", "holder": error.holder})
        return Again("busy", jitter(error.retry_after, busy, draw))
    if isinstance(error, LostOwnership):
        epoch = counts.get("epoch", 0)
        if epoch + 1 >= limits.epochs:
            reason = f"lost ownership {epoch + 1} times"
            return Final(RequestStatus.DEAD_LETTERED, {"reason": reason, "last": str(error)})
        return Again("epoch", jitter(0.01, epoch, draw))
    if isinstance(error, BackendUnavailable):
        transient = counts.get("transient", 0)
        if transient >= limits.transient:
            return Final(
                RequestStatus.DEAD_LETTERED, {"reason": "backend unavailable", "error": str(error)[:500]}
            )
        ceiling = min(TRANSIENT_CEILING, 0.2 * 2**transient)
        return Again("transient", draw.uniform(ceiling / 2, ceiling))
    return Final(RequestStatus.DEAD_LETTERED, {"reason": "unexpected error", "error": repr(error)[:500]})


def jitter(retry_after: float, attempt: int, draw: Random = rng) -> float:
    """Backoff between task retries: the lease backoff with a broker round trip's larger steps."""
    return backoff(attempt, retry_after, draw, first=0.01, cap=1.0, floor=0.005)


def lost_with_the_lease(leases: dict[str, Lease], exc: BackendUnavailable) -> LeaseLost | None:
    """A database error after the lease ran out is lost ownership, not a passing outage: the database
    ends a transaction left idle past the lease ttl (a frozen or cut-off worker), so the rows it locked
    go to the next holder instead of waiting for the pause to end."""
    for lease in leases.values():
        if lease.lost or lease.time_left() <= 0:
            reason = f"the database ended the transaction after the lease ran out: {exc}"
            return LeaseLost(scope=lease.scope, token=lease.token, lease_id=lease.lease_id, reason=reason)
    return None


def printable(error: BaseException, limit: int = 500) -> str:
    """An error as stored free text: a database's message may carry newlines or tabs, which the attempt
    log refuses (it is printed by the CLI)."""
    return "".join(ch if ch.isprintable() else " " for ch in str(error))[:limit]
