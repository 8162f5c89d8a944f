"""Requests a front door accepted, by idempotency key: the difference between "in flight" and "never seen".

An HTTP caller that retries must hear the truth about its key: the outcome once there is one; "still in
flight" while a request published under it has none; "never seen" otherwise; and "used for a different
request" as soon as that is known, before anything is published. The outcome rows answer the first
(reservations.requests); this module records the rest, once per key, before the request is published.
The record names the request by the fingerprint its outcome will carry, so a reuse with other arguments
is refused at the door rather than after a worker ran.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from fencing.plan import Alone, Plan
from fencing.sql import Rows, db_now_ms
from reservations import validation as valid
from reservations.errors import KeyTaken
from reservations.models import accepted_requests
from reservations.requests import RequestResult, request_outcome


@dataclass(frozen=True, slots=True)
class Accepted:
    """A request recorded as accepted under ``key``: its operation and fingerprint, when it was accepted
    and its deadline (seconds since the epoch, database clock for ``at``)."""

    key: str
    operation: str
    fingerprint: str
    at: float
    deadline: float | None

    def names(self, operation: str, fingerprint: str) -> bool:
        """Whether this record is of the request with this operation and fingerprint."""
        return self.operation == operation and self.fingerprint == fingerprint


@dataclass(frozen=True, slots=True)
class Admission:
    """What the key holds when a request arrives under it: its final ``outcome`` (then nothing was
    recorded), or the ``accepted`` record, which is this request's own when ``first``."""

    outcome: RequestResult | None
    accepted: Accepted | None
    first: bool


_ACCEPTED = sa.select(accepted_requests).where(accepted_requests.c.key == sa.bindparam("key"))


def _accepted_of(row: sa.Row[tuple[object, ...]]) -> Accepted:
    return Accepted(
        key=row.key,
        operation=row.operation,
        fingerprint=row.fingerprint,
        at=row.at_ms / 1000,
        deadline=None if row.deadline_ms is None else row.deadline_ms / 1000,
    )


def admit(key: str, operation: str, fingerprint: str, deadline: float | None) -> Plan[Admission]:
    """The key's outcome if it has one; else record this request as accepted under it, or read the
    request recorded first (two round trips either way on PostgreSQL: each step is a statement alone)."""
    valid.idempotency_key(key)
    outcome = yield from request_outcome(key)
    if outcome is not None:
        return Admission(outcome=outcome, accepted=None, first=False)
    deadline_ms = None if deadline is None else round(deadline * 1000)
    try:
        made: Rows = yield Alone(
            sa.insert(accepted_requests)
            .values(
                key=key,
                operation=operation,
                fingerprint=fingerprint,
                at_ms=db_now_ms(),
                deadline_ms=deadline_ms,
            )
            .returning(*accepted_requests.c)
        )
        return Admission(outcome=None, accepted=_accepted_of(made.rows[0]), first=True)
    except KeyTaken as taken:
        if taken.where != "acceptance":
            raise
    found: Rows = yield Alone(_ACCEPTED, {"key": key})
    row = found.first()
    if row is None:  # withdrawn between the two statements: this request may take the key after all
        return (yield from admit(key, operation, fingerprint, deadline))
    return Admission(outcome=None, accepted=_accepted_of(row), first=False)


def accepted(key: str) -> Plan[Accepted | None]:
    """The request accepted under ``key``, or None."""
    found: Rows = yield Alone(_ACCEPTED, {"key": valid.idempotency_key(key)})
    row = found.first()
    return None if row is None else _accepted_of(row)


def withdraw(key: str, fingerprint: str) -> Plan[bool]:
    """Take back the acceptance of a request that could not be published (its broker was unreachable),
    so a retry under the key is accepted afresh; only that request's record goes. True when it went."""
    gone: Rows = yield Alone(
        sa.delete(accepted_requests)
        .where(accepted_requests.c.key == valid.idempotency_key(key))
        .where(accepted_requests.c.fingerprint == fingerprint)
        .returning(accepted_requests.c.key)
    )
    return bool(gone.rows)
