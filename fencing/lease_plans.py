"""Lease plans: the validation, waiting, backoff and repair decisions behind both lease managers.

Each backend core (Redis, SQL) supplies one plan per operation; :class:`LeasePlans` wraps them in what
every caller needs, once, for the sync and the async shell of :mod:`fencing.manager` to drive.
"""

from __future__ import annotations

import logging
import os
import random
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from fencing.errors import BackendUnavailable, FencingError, InvalidLeaseRequest, LeaseBusy, StaleToken
from fencing.lease import (
    Clock,
    Lease,
    LeaseEvent,
    LeaseInfo,
    check_lease,
    new_lease_id,
    validate_holder,
    validate_reason,
    validate_retention,
    validate_scope,
    validate_token,
    validate_ttl,
)
from fencing.plan import Atomic, Plan, Sleep

log = logging.getLogger("fencing")

# Redis keeps each scope's last DEFAULT_HISTORY_CAP epochs (a short list, about 140 bytes an entry, that
# expires once the scope is idle for the retention): with its counter about 750 bytes a scope, whatever
# its age. The SQL backend keeps events until purge_history removes those older than the retention. The
# durable record of every token is the protected resource's own: each accepted write and each refused
# stale write carries its token and holder.
DEFAULT_HISTORY_CAP = 4
MAX_HISTORY_CAP = 100_000
DEFAULT_HISTORY_RETENTION = 30 * 24 * 3600.0
MAX_HISTORY_LIMIT = 10_000
# Scopes read in one current_many: one pipeline or one statement each (a list of keys that size stays a
# few hundred kilobytes).
MAX_SCOPES_READ = 1_000


class LeaseCore(Protocol):
    """What each backend (Redis, SQL) provides: one plan per operation, decisions and parsing only."""

    backend: str

    def acquire(self, scope: str, ttl: float, holder: str, lease_id: str) -> Plan[Lease | LeaseBusy]:
        """A new lease, or (returned, not raised, so that the mark it leaves on the lease is kept) the
        refusal of a busy scope."""
        ...

    def renew(self, lease: Lease) -> Plan[Lease]: ...

    def release(self, lease: Lease) -> Plan[bool]:
        """End the lease; returns whether another acquirer found it busy while it was held."""
        ...

    def break_lease(self, scope: str, reason: str) -> Plan[LeaseInfo | None]: ...
    def repair(self, lease: Lease, highest: int) -> Plan[tuple[int, int] | None]: ...
    def current(self, scope: str) -> Plan[LeaseInfo | None]: ...
    def current_many(self, scopes: list[str]) -> Plan[list[LeaseInfo | None]]: ...
    def history(self, scope: str, limit: int) -> Plan[list[LeaseEvent]]: ...
    def purge_history(self, older_than_ms: int) -> Plan[int]: ...


def backoff(
    attempt: int,
    retry_after: float,
    rng: random.Random,
    *,
    first: float = 0.005,
    cap: float = 0.5,
    floor: float = 0.001,
) -> float:
    """Full-jitter exponential backoff, capped by the time the current lease has left.

    The holder usually releases long before its ttl runs out, so ``retry_after`` is a ceiling, not a wait.
    """
    ceiling = min(cap, first * 2 ** min(attempt, 30))
    return min(max(retry_after, floor), rng.uniform(floor, ceiling))


# A renewal the coordinator did not answer is asked again after this, while the lease has at least twice
# as long left on its local clock.
RETRY_UNANSWERED = 0.05


@dataclass(frozen=True, slots=True)
class RenewalVerdict:
    """What a renewer does after a failed renewal: ask again in ``retry_in`` seconds or, when that is None,
    mark the lease lost for ``reason``."""

    reason: str
    retry_in: float | None = None


def renewal_verdict(error: Exception, time_left: float) -> RenewalVerdict:
    """The verdict on a renewal that raised ``error`` while the lease had ``time_left`` seconds left on its
    local clock, for the renewers of both shells (a thread for the sync one, a task for the async one).

    An unanswered renewal (:class:`BackendUnavailable`) may well have left the lease held: the answer, not
    the lease, went missing, so it is asked again while there is time for another try, and a coordinator
    stalled for less than the ttl costs no lease. Any other failure, or too little time, and the lease
    cannot be assumed renewed."""
    reason = f"renewal failed: {error}" if isinstance(error, FencingError) else f"renewal failed: {error!r}"
    if isinstance(error, BackendUnavailable) and time_left > 2 * RETRY_UNANSWERED:
        return RenewalVerdict(reason, retry_in=RETRY_UNANSWERED)
    return RenewalVerdict(reason)


class LeasePlans:
    """Validation and decisions shared by both shells."""

    def __init__(self, core: LeaseCore, clock: Clock, rng: random.Random | None = None) -> None:
        self.core = core
        self.clock = clock
        self.rng = rng or random.Random()

    def acquire(self, scope: str, ttl: float, holder: str | None, wait: float) -> Plan[Lease]:
        validate_scope(scope)
        ttl = validate_ttl(ttl)
        holder = validate_holder(default_holder() if holder is None else holder)
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= 3600:
            raise InvalidLeaseRequest("wait must be between 0 and 3600 seconds")
        deadline = self.clock() + wait
        attempt = 0
        while True:
            got: Lease | LeaseBusy = yield Atomic(self.core.acquire(scope, ttl, holder, new_lease_id()))
            if isinstance(got, Lease):
                return got
            left = deadline - self.clock()
            if left <= 0:
                raise got
            yield Sleep(min(left, backoff(attempt, got.retry_after, self.rng)))
            attempt += 1

    def renew(self, lease: Lease) -> Plan[Lease]:
        check_lease(lease).raise_if_lost()  # renewal never resurrects a lost lease
        renewed: Lease = yield Atomic(self.core.renew(lease))
        return renewed

    def release(self, lease: Lease) -> Plan[None]:
        contended: bool = yield Atomic(self.core.release(check_lease(lease)))
        lease._released(contended)
        # Authority ends with the release: a write issued after it is refused here, without a round trip.
        lease.mark_lost("released by its holder")

    def current(self, scope: str) -> Plan[LeaseInfo | None]:
        info: LeaseInfo | None = yield Atomic(self.core.current(validate_scope(scope)))
        return info

    def current_many(self, scopes: Sequence[str]) -> Plan[dict[str, LeaseInfo]]:
        checked = [validate_scope(scope) for scope in scopes]
        if not 1 <= len(checked) <= MAX_SCOPES_READ:
            raise InvalidLeaseRequest(f"read the leases of 1 to {MAX_SCOPES_READ} scopes at a time")
        found: list[LeaseInfo | None] = yield Atomic(self.core.current_many(checked))
        return {info.scope: info for info in found if info is not None}

    def history(self, scope: str, limit: int) -> Plan[list[LeaseEvent]]:
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_HISTORY_LIMIT:
            raise InvalidLeaseRequest(f"limit must be between 1 and {MAX_HISTORY_LIMIT}")
        events: list[LeaseEvent] = yield Atomic(self.core.history(validate_scope(scope), limit))
        return events

    def purge_history(self, older_than: float) -> Plan[int]:
        purged: int = yield Atomic(self.core.purge_history(round(validate_retention(older_than) * 1000)))
        return purged

    def break_lease(self, scope: str, reason: str) -> Plan[LeaseInfo | None]:
        validate_reason(reason)
        info: LeaseInfo | None = yield Atomic(self.core.break_lease(validate_scope(scope), reason))
        if info is not None:
            log.warning(
                "lease on %r (token %d, holder %r) broken: %s",
                scope,
                info.token,
                info.holder,
                reason,
                extra={
                    "event": "lease_broken",
                    "scope": scope,
                    "token": info.token,
                    "holder": info.holder,
                    "reason": reason,
                },
            )
        return info

    def handle_stale(self, lease: Lease, error: StaleToken) -> Plan[bool]:
        """Repair a coordinator whose counter went backwards; True if it did.

        Only a holder that is still current at the coordinator proves the coordinator is behind; any
        other stale rejection is an ordinary lost race and needs nothing. Either way the rejected
        attempt stays lost.
        """
        if not isinstance(error, StaleToken):
            raise InvalidLeaseRequest(f"expected a StaleToken, got {type(error).__name__}")
        if check_lease(lease).scope != error.scope or error.presented != lease.token:
            return False  # another lease's rejection says nothing about this one
        # Checked before anything changes: raising the counter past MAX_TOKEN would leave it unable to
        # issue another token, or overflow it.
        validate_token(error.highest, scope=lease.scope)
        lease.mark_lost(f"stale: resource accepted token {error.highest}")
        repaired = yield Atomic(self.core.repair(lease, error.highest))
        if repaired is None:
            return False
        old, new = repaired
        log.warning(
            "fencing token regression on scope %r: the coordinator had issued %d but the resource "
            "has accepted %d; counter raised from %d to %d",
            lease.scope,
            lease.token,
            error.highest,
            old,
            new,
            extra={
                "event": "token_regression_repaired",
                "scope": lease.scope,
                "token": lease.token,
                "highest": error.highest,
                "holder": lease.holder,
                "lease_id": lease.lease_id,
                "counter_from": old,
                "counter_to": new,
            },
        )
        return True


def default_holder() -> str:
    """``host:pid``: enough for an operator to find the process that holds a lease."""
    return f"{socket.gethostname()}:{os.getpid()}"
