"""Lease values and the validation of everything a caller hands the fencing package.

A :class:`Lease` names one ownership epoch of a scope: its token never changes, renewals only move the
local deadline. Once a lease is known lost it stays lost, and guarded writes refuse it without a round trip.
"""

from __future__ import annotations

import math
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fencing.errors import InvalidLeaseRequest, LeaseLost

Clock = Callable[[], float]

MAX_SCOPE_CHARS = 200
MAX_HOLDER_CHARS = 200
MIN_TTL = 0.01
MAX_TTL = 24 * 3600.0
MAX_TOKEN = 2**63 - 1
_LEASE_ID = re.compile(r"[0-9a-f]{32}")


def _has_control(text: str) -> bool:
    return any(ord(ch) < 32 or 0x7F <= ord(ch) < 0xA0 or 0xD800 <= ord(ch) < 0xE000 for ch in text)


def validate_scope(scope: object) -> str:
    """Return ``scope`` if it is a usable scope name, else raise :class:`InvalidLeaseRequest`."""
    if not isinstance(scope, str):
        raise InvalidLeaseRequest(f"scope must be a string, not {type(scope).__name__}")
    if not scope or scope.strip() != scope:
        raise InvalidLeaseRequest("scope must be non-empty and carry no leading or trailing spaces")
    if len(scope) > MAX_SCOPE_CHARS:
        raise InvalidLeaseRequest(f"scope is {len(scope)} characters, the limit is {MAX_SCOPE_CHARS}")
    if _has_control(scope):
        raise InvalidLeaseRequest("scope contains control characters or lone surrogates")
    return scope


def validate_holder(holder: object) -> str:
    if not isinstance(holder, str) or not holder:
        raise InvalidLeaseRequest("holder must be a non-empty string such as 'host:pid:task'")
    if len(holder) > MAX_HOLDER_CHARS:
        raise InvalidLeaseRequest(f"holder is {len(holder)} characters, limit {MAX_HOLDER_CHARS}")
    if _has_control(holder):
        raise InvalidLeaseRequest("holder contains control characters or lone surrogates")
    return holder


def validate_ttl(ttl: object) -> float:
    """A ttl in seconds: a finite number between 10 ms and one day."""
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise InvalidLeaseRequest(f"ttl must be a number of seconds, not {type(ttl).__name__}")
    if not math.isfinite(ttl) or not MIN_TTL <= ttl <= MAX_TTL:
        raise InvalidLeaseRequest(f"ttl must be between {MIN_TTL} and {MAX_TTL} seconds, got {ttl!r}")
    return float(ttl)


def validate_token(token: object) -> int:
    """A fencing token is a positive signed 64-bit integer (what a BIGINT column holds)."""
    if isinstance(token, bool) or not isinstance(token, int):
        raise InvalidLeaseRequest(f"token must be an integer, not {type(token).__name__}")
    if not 1 <= token <= MAX_TOKEN:
        raise InvalidLeaseRequest(f"token must be between 1 and 2**63-1, got {token}")
    return token


def validate_lease_id(lease_id: object) -> str:
    if not isinstance(lease_id, str) or not _LEASE_ID.fullmatch(lease_id):
        raise InvalidLeaseRequest("lease_id must be 32 lowercase hex characters")
    return lease_id


def new_lease_id() -> str:
    """128 random bits: the proof of identity for renew and release, unguessable by other holders."""
    return secrets.token_hex(16)


class _LeaseStatus:
    """Mutable part shared by a lease and its renewals: the local deadline and the sticky loss."""

    __slots__ = ("_lock", "deadline", "lost_reason")

    def __init__(self, deadline: float) -> None:
        self._lock = threading.Lock()
        self.deadline = deadline
        self.lost_reason: str | None = None

    def extend(self, deadline: float) -> None:
        with self._lock:
            if self.lost_reason is None:
                self.deadline = max(self.deadline, deadline)

    def lose(self, reason: str) -> None:
        with self._lock:
            if self.lost_reason is None:
                self.lost_reason = reason


@dataclass(frozen=True, slots=True)
class Lease:
    """One ownership epoch of ``scope``.

    ``acquired_at`` is read from the local monotonic clock just before the acquire request was sent, so
    the local deadline errs early: a lease the holder still believes valid may already be gone at the
    coordinator only by the clock drift between the two, never by the request's own latency.
    The fence, not this deadline, is what makes writes safe.
    """

    scope: str
    token: int
    lease_id: str = field(repr=False)
    holder: str
    ttl: float
    acquired_at: float
    clock: Clock = field(default=time.monotonic, repr=False, compare=False)
    _status: _LeaseStatus = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        validate_scope(self.scope)
        validate_token(self.token)
        validate_lease_id(self.lease_id)
        validate_holder(self.holder)
        validate_ttl(self.ttl)
        object.__setattr__(self, "_status", _LeaseStatus(self.acquired_at + self.ttl))

    @property
    def expires_at(self) -> float:
        """Local monotonic deadline, moved forward by each successful renewal."""
        return self._status.deadline

    def time_left(self) -> float:
        return self._status.deadline - self.clock()

    @property
    def lost(self) -> bool:
        return self._status.lost_reason is not None

    @property
    def lost_reason(self) -> str | None:
        return self._status.lost_reason

    def mark_lost(self, reason: str) -> None:
        """Record that authority is gone. Sticky: nothing un-loses a lease."""
        self._status.lose(reason)

    def ensure_held(self, margin: float = 0.0) -> None:
        """Raise :class:`LeaseLost` if the lease is known lost or will expire locally within ``margin``.

        Use before *starting* a mutation to avoid useless work; it cannot make the write safe.
        """
        if self._status.lost_reason is not None:
            raise LeaseLost(
                scope=self.scope, token=self.token, lease_id=self.lease_id, reason=self._status.lost_reason
            )
        if self.time_left() <= margin:
            raise LeaseLost(
                scope=self.scope,
                token=self.token,
                lease_id=self.lease_id,
                reason=f"local deadline within the {margin:.3f}s safety margin",
            )

    def raise_if_lost(self) -> None:
        """Raise :class:`LeaseLost` if a renewal failed or a write was already rejected as stale."""
        if self._status.lost_reason is not None:
            raise LeaseLost(
                scope=self.scope, token=self.token, lease_id=self.lease_id, reason=self._status.lost_reason
            )

    def _renewed(self, sent_at: float) -> None:
        self._status.extend(sent_at + self.ttl)


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """What the coordinator says about a scope's current lease (no lease id: that is the holder's)."""

    scope: str
    token: int
    holder: str
    time_left: float


@dataclass(frozen=True, slots=True)
class LeaseEvent:
    """One entry of a scope's lease history: ``acquired``, ``released``, ``broken`` or ``repaired``.

    For ``acquired``, ``previous_token`` and ``previous_end`` ("released", "expired", "broken" or None for
    the scope's first epoch) say how the epoch before it ended. ``at`` is the coordinator's wall clock.
    """

    scope: str
    event: str
    token: int
    holder: str | None
    lease_id: str | None
    at: float
    previous_token: int | None = None
    previous_end: str | None = None
    detail: str | None = None
