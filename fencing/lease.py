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

from fencing.errors import InvalidLeaseRequest, LeaseLost, TokenOverflow

Clock = Callable[[], float]

MAX_SCOPE_CHARS = 200
MAX_HOLDER_CHARS = 200
MIN_TTL = 0.01
MAX_TTL = 24 * 3600.0
# The largest fencing token: 2**53 - 1, not the 2**63 - 1 a BIGINT holds. Redis runs its scripts on Lua
# 5.1, whose one number type is a double, so a counter the acquire and repair scripts read, compare and
# hand back is exact only up to 2**53; so is every JSON reader that parses numbers as doubles (dashboards,
# jq). 2**62 would leave int64 headroom but not exactness: two tokens near it compare equal in Lua. Far
# below int64, a counter at the limit also cannot overflow Redis's HINCRBY or a BIGINT column if a check
# were ever missed. The range lasts 285 years at a million acquisitions a second on one scope.
MAX_TOKEN = 2**53 - 1
# Retentions beyond a century are a mistake, and their milliseconds must still fit a BIGINT.
MAX_RETENTION = 100 * 365 * 24 * 3600.0
MAX_REASON_CHARS = 500
_LEASE_ID = re.compile(r"[0-9a-f]{32}")


# One regex scan instead of a Python loop per character: every lease and request passes through here.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def has_control(text: str) -> bool:
    """Control characters and lone surrogates: what no stored name or free text may carry (PostgreSQL
    refuses NUL in text, a surrogate cannot be encoded, and the rest garbles logs and terminals)."""
    return _CONTROL.search(text) is not None


def _text(value: object, what: str, limit: int) -> str:
    """``value`` if it is a non-empty string of at most ``limit`` printable characters, else
    :class:`InvalidLeaseRequest` naming it ``what``."""
    if not isinstance(value, str) or not value:
        raise InvalidLeaseRequest(f"{what} must be a non-empty string")
    if len(value) > limit:
        raise InvalidLeaseRequest(f"{what} is {len(value)} characters, the limit is {limit}")
    if has_control(value):
        raise InvalidLeaseRequest(f"{what} contains control characters or lone surrogates")
    return value


def validate_scope(scope: object) -> str:
    """Return ``scope`` if it is a usable scope name, else raise :class:`InvalidLeaseRequest`."""
    text = _text(scope, "scope", MAX_SCOPE_CHARS)
    if text.strip() != text:
        raise InvalidLeaseRequest("scope must carry no leading or trailing spaces")
    return text


def validate_holder(holder: object) -> str:
    """Who holds a lease, for operators: ``host:pid:task``; printable, at most 200 characters."""
    return _text(holder, "holder", MAX_HOLDER_CHARS)


def _seconds(value: object, what: str, low: float, high: float, *, ranged: str = "") -> float:
    """``value`` as a finite number of seconds from ``low`` to ``high``; the refusal names it ``what``
    (``ranged``, if given, when it is out of range)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidLeaseRequest(f"{what} must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or not low <= value <= high:
        raise InvalidLeaseRequest(f"{ranged or what} must be between {low} and {high} seconds, got {value!r}")
    return float(value)


def validate_ttl(ttl: object) -> float:
    """A ttl in seconds: a finite number between 10 ms and one day."""
    return _seconds(ttl, "ttl", MIN_TTL, MAX_TTL)


def validate_token(token: object, *, scope: str | None = None) -> int:
    """A fencing token: an integer from 1 to :data:`MAX_TOKEN`; :class:`TokenOverflow` beyond it."""
    if isinstance(token, bool) or not isinstance(token, int):
        raise InvalidLeaseRequest(f"token must be an integer, not {type(token).__name__}")
    if token > MAX_TOKEN:
        raise TokenOverflow(token=token, limit=MAX_TOKEN, scope=scope)
    if token < 1:
        raise InvalidLeaseRequest(f"token must be between 1 and {MAX_TOKEN}, got {token}")
    return token


def parse_token(raw: object) -> int | None:
    """A token as stored by a backend (an int, or decimal digits in Redis), or None when it is not one:
    history readers skip what they cannot trust instead of failing on it. 0 means "none yet"."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, str):
        if not raw.isascii() or not raw.isdigit() or len(raw) > 16:
            return None
        raw = int(raw)
    if not isinstance(raw, int) or not 0 <= raw <= MAX_TOKEN:
        return None
    return raw


def check_lease(lease: object) -> Lease:
    """``lease`` if it is a :class:`Lease` whose token is in range (a frozen dataclass can still be
    altered with ``object.__setattr__``), before it reaches a coordinator or a fenced row."""
    if not isinstance(lease, Lease):
        raise InvalidLeaseRequest(f"expected a Lease, got {type(lease).__name__}")
    validate_token(lease.token, scope=lease.scope)
    return lease


def validate_reason(reason: object) -> str:
    """Free text an operator gives (why a lease was broken): stored and printed, so printable."""
    return _text(reason, "reason", MAX_REASON_CHARS)


def validate_retention(older_than: object) -> float:
    """How long history is kept, in seconds: at least a minute, at most :data:`MAX_RETENTION`."""
    return _seconds(older_than, "retention", 60, round(MAX_RETENTION), ranged="history retention")


def validate_renew_every(renew_every: object) -> float | None:
    """The background renewal interval: None (a third of the ttl) or a finite number of seconds within
    the ttl's own bounds, so a renewal loop can neither spin on zero nor fail on NaN."""
    return None if renew_every is None else _seconds(renew_every, "renew_every", MIN_TTL, MAX_TTL)


def ttl_ms(seconds: float) -> int:
    """A ttl in whole milliseconds, at least 1, as the backends store it."""
    return max(1, round(seconds * 1000))


def new_lease_id() -> str:
    """128 random bits: the proof of identity for renew and release, unguessable by other holders."""
    return secrets.token_hex(16)


class _LeaseStatus:
    """Mutable part shared by a lease and its renewals: the local deadline, the sticky loss, and what
    the release reported about contention."""

    __slots__ = ("_lock", "contended", "deadline", "lost_reason")

    def __init__(self, deadline: float) -> None:
        self._lock = threading.Lock()
        self.deadline = deadline
        self.lost_reason: str | None = None
        self.contended: bool | None = None

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
        validate_token(self.token, scope=self.scope)
        if not isinstance(self.lease_id, str) or not _LEASE_ID.fullmatch(self.lease_id):
            raise InvalidLeaseRequest("lease_id must be 32 lowercase hex characters")
        validate_holder(self.holder)
        validate_ttl(self.ttl)
        acquired = self.acquired_at
        if isinstance(acquired, bool) or not isinstance(acquired, int | float) or not math.isfinite(acquired):
            raise InvalidLeaseRequest("acquired_at must be a finite reading of the lease's clock")
        if not callable(self.clock):
            raise InvalidLeaseRequest("clock must be a callable returning monotonic seconds")
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
        self.raise_if_lost()
        if self.time_left() <= margin:
            raise self.lose(f"local deadline within the {margin:.3f}s safety margin", mark=False)

    def raise_if_lost(self) -> None:
        """Raise :class:`LeaseLost` if a renewal failed or a write was already rejected as stale."""
        if self._status.lost_reason is not None:
            raise self.lose(self._status.lost_reason, mark=False)

    def lose(self, reason: str, *, mark: bool = True) -> LeaseLost:
        """The :class:`LeaseLost` that says ``reason``, the lease marked lost for it first (``mark``)."""
        if mark:
            self.mark_lost(reason)
        return LeaseLost(scope=self.scope, token=self.token, lease_id=self.lease_id, reason=reason)

    @property
    def contended(self) -> bool | None:
        """Whether another acquirer found this lease busy while it was held, as its release reported:
        None until the holder released it (or when the release could not tell). Work that others hand to
        the holder while it holds the lease (a queue in the resource) needs a look after the release only
        when this is not False."""
        return self._status.contended

    def _renewed(self, sent_at: float) -> None:
        self._status.extend(sent_at + self.ttl)

    def _released(self, contended: bool) -> None:
        self._status.contended = contended


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
