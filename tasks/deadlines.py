"""A request's deadline: after it, a worker that takes the request up ends it ``expired`` without touching
stock or taking a lease, so a backlog drained after an outage does not reserve stock for carts abandoned
long ago.

The deadline travels as a message header (:data:`DEADLINE`), not as an argument: the arguments make the
request's fingerprint, and the same request sent again with another deadline is still the same request;
a worker that does not know the header ignores it, so workers can be upgraded one by one. A retry keeps
its request's deadline (tasks.app). Deciding is kept apart from recording (tasks.attempt), with the clock a
parameter, so the decision is tested without services.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reservations import validation as valid
from reservations.errors import InvalidRequest
from tasks.messages import DEADLINE

log = logging.getLogger("tasks.deadlines")


@dataclass(frozen=True, slots=True)
class Late:
    """A request taken up ``late_by`` seconds after its ``deadline`` (seconds since the epoch)."""

    deadline: float
    late_by: float

    def detail(self, attempts: int = 0) -> dict[str, Any]:
        """The ``expired`` outcome's detail: the deadline, how late the request was taken up (seconds), and
        how many attempts workers made at it before (retries of every kind: 0 when it was first taken up
        past its deadline)."""
        return {"deadline": self.deadline, "late_by": round(self.late_by, 3), "attempts": attempts}

    def describe(self) -> str:
        return f"taken up {self.late_by:.3f}s after its deadline {self.deadline:.3f}"


def header(deadline: float | None) -> dict[str, float]:
    """The headers a message carries for ``deadline`` (checked; none for None)."""
    checked = valid.deadline(deadline)
    return {} if checked is None else {DEADLINE: checked}


def late(value: object, *, clock: Callable[[], float] = time.time, key: object = None) -> Late | None:
    """Whether a request whose message carried ``value`` in its deadline header is taken up too late at
    ``clock()``: None without a deadline (``value`` None: the header is absent), before it, and for a
    malformed one (:func:`carried`)."""
    deadline = carried(value, key=key)
    if deadline is None:
        return None
    now = clock()
    return Late(deadline, now - deadline) if now > deadline else None


def carried(value: object, *, key: object = None) -> float | None:
    """The deadline a message's header ``value`` names; None without one, and for a malformed one, which
    is logged (naming ``key``) and ignored: a sender's bad header must not cost the request its outcome."""
    try:
        deadline = valid.deadline(value)
    except InvalidRequest as exc:
        log.warning(
            "ignoring the malformed %s header %r of request %s: %s",
            DEADLINE,
            value,
            key,
            exc,
            extra={"event": "malformed_deadline", "key": key},
        )
        return None
    return deadline
