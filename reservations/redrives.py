"""Dead letters, and driving them again under a key of their own (why one outcome per key stays true:
docs/architecture.md, "Dead letters driven again"). A re-drive needs the request's arguments, which the
dead-lettering paths record in the outcome's detail (``request``: its type and arguments, as its message
carried them); a dead letter written before they did is listed, but refused for re-drive.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from fencing.plan import Alone, Atomic, Plan
from fencing.sql import Rows, db_now_ms
from reservations import validation as valid
from reservations.errors import InvalidRequest, KeyTaken, RedriveRefused, UnknownRequest
from reservations.models import request_outcomes, request_redrives
from reservations.request_outcomes import RequestResult, result_of
from reservations.statuses import RequestStatus

REDRIVE_MARK = "~redrive-"
_REDRIVE_END = re.compile(re.escape(REDRIVE_MARK) + r"[0-9]+\Z")  # how every re-drive key ends
# A request driven again this often is not coming back by itself: look at it instead.
MAX_REDRIVE_NUMBER = 1000
DEAD = RequestStatus.DEAD_LETTERED


def carried_request(request_type: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """What a dead letter records of its request so it can be driven again: its type (``reserve``,
    ``reserve_order``, ...) and its checked arguments, without the unset ones."""
    return {"type": request_type, "arguments": {k: v for k, v in arguments.items() if v is not None}}


def redrive_key(origin: str, number: int) -> str:
    """The key of the ``number``-th re-drive of ``origin``: ``<origin>~redrive-<number>``, within the key
    length limit. A key too long for the suffix keeps its start and a digest of the whole, so two long
    keys never share a re-drive key."""
    valid.idempotency_key(origin)
    suffix = f"{REDRIVE_MARK}{number}"
    if len(origin) + len(suffix) <= valid.MAX_KEY_CHARS:
        return origin + suffix
    digest = hashlib.sha256(origin.encode()).hexdigest()[:16]
    keep = valid.MAX_KEY_CHARS - len(suffix) - len(digest) - 1
    return valid.idempotency_key(f"{origin[:keep]}~{digest}{suffix}")


def is_redrive_key(key: str) -> bool:
    """Whether ``key`` is a name :func:`redrive_key` makes (it ends in ``~redrive-<n>``): such a name
    belongs to the re-drives of the key before it, and a request sent under it by anyone else would be
    taken for that key's re-drive."""
    return _REDRIVE_END.search(key) is not None


@dataclass(frozen=True, slots=True)
class RedriveLink:
    """One re-drive of ``origin``: its key and number, when and by whom, and its outcome's status (None
    while it has none)."""

    origin: str
    key: str
    number: int
    at: float
    by: str | None
    status: str | None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A dead-lettered request as an operator sees it: its own outcome row, the request it carried (None
    for a dead letter that did not record it) and its latest re-drive (None: never driven again)."""

    key: str
    operation: str
    request_type: str | None
    arguments: dict[str, Any] | None
    reason: str
    error: str | None
    at: float
    worker: str | None
    task_id: str | None
    redrive: RedriveLink | None

    @property
    def redrivable(self) -> bool:
        """Whether :func:`claim` would take it now (the same rules, without the race)."""
        return self.arguments is not None and (self.redrive is None or self.redrive.status == DEAD)


@dataclass(frozen=True, slots=True)
class Redrive:
    """A claimed re-drive, to be sent: the new request's key, type and arguments."""

    origin: str
    key: str
    number: int
    request_type: str
    arguments: dict[str, Any]
    by: str | None


def _carried(result: RequestResult) -> tuple[str | None, dict[str, Any] | None]:
    request = result.detail.get("request")
    if not isinstance(request, dict):
        return None, None
    kind, arguments = request.get("type"), request.get("arguments")
    if not isinstance(kind, str) or not isinstance(arguments, dict):
        return None, None
    return kind, arguments


def _link(row: Any, status: str | None) -> RedriveLink:
    return RedriveLink(row.origin_key, row.redrive_key, row.number, row.at_ms / 1000, row.by, status)


def _dead_letter(result: RequestResult, latest: RedriveLink | None) -> DeadLetter:
    kind, arguments = _carried(result)
    reason, error = result.detail.get("reason"), result.detail.get("error", result.detail.get("last"))
    return DeadLetter(
        key=result.key,
        operation=result.operation,
        request_type=kind,
        arguments=arguments,
        reason=reason if isinstance(reason, str) else "",
        error=error if isinstance(error, str) else None,
        at=result.at,
        worker=result.worker,
        task_id=result.task_id,
        redrive=latest,
    )


def _rows_of(query: sa.Select[Any], column: sa.Column[str], keys: list[str]) -> Plan[list[Any]]:
    """The rows of ``query`` whose ``column`` is one of ``keys``, asked 1,000 keys at a time."""
    rows: list[Any] = []
    for start in range(0, len(keys), 1000):
        found: Rows = yield query.where(column.in_(keys[start : start + 1000]))
        rows.extend(found.rows)
    return rows


def _latest_links(origins: list[str]) -> Plan[dict[str, RedriveLink]]:
    """The latest re-drive of each of ``origins`` that has one, with its outcome's status."""
    links = sa.select(request_redrives).order_by(request_redrives.c.origin_key, request_redrives.c.number)
    found = yield from _rows_of(links, request_redrives.c.origin_key, origins)
    latest = {row.origin_key: row for row in found}  # ordered by number: the last one wins
    ended = sa.select(request_outcomes.c.key, request_outcomes.c.status)
    keys = [row.redrive_key for row in latest.values()]
    status = {row.key: row.status for row in (yield from _rows_of(ended, request_outcomes.c.key, keys))}
    return {origin: _link(row, status.get(row.redrive_key)) for origin, row in latest.items()}


def dead_letters(
    *, since: float | None = None, reason: str | None = None, limit: int = 1000
) -> Plan[list[DeadLetter]]:
    """The dead-lettered requests, newest first: each by the key it was sent under, with its latest
    re-drive. A re-drive that dead-lettered is shown through its origin (which may then be driven again),
    and ``since`` counts from the latest dead letter of the chain. ``reason``: only those whose reason
    starts with it."""
    since = valid.since(since)
    valid.limit(limit)
    if reason is not None and not valid.text(reason, field="reason", max_chars=valid.MAX_REASON_CHARS):
        raise InvalidRequest("reason must not be empty", field="reason")
    query = sa.select(request_outcomes).where(request_outcomes.c.status == DEAD)
    if since is not None:
        query = query.where(request_outcomes.c.at_ms >= round(since * 1000))
    found: Rows = yield query.order_by(request_outcomes.c.at_ms.desc(), request_outcomes.c.key)
    dead = [result_of(row) for row in found.rows]
    # A re-drive's dead letter stands for its origin: the chain is one entry, under the origin's key.
    keys = [d.key for d in dead]
    links = sa.select(request_redrives.c.redrive_key, request_redrives.c.origin_key)
    chained = yield from _rows_of(links, request_redrives.c.redrive_key, keys)
    origin_of = {row.redrive_key: row.origin_key for row in chained}
    origins = list(dict.fromkeys(origin_of.get(d.key, d.key) for d in dead))  # newest first, once each
    own: dict[str, RequestResult] = {d.key: d for d in dead}
    missing = [o for o in origins if o not in own]
    more = yield from _rows_of(sa.select(request_outcomes), request_outcomes.c.key, missing)
    own.update({row.key: result_of(row) for row in more})
    latest = yield from _latest_links([o for o in origins if o in own])
    listed = [_dead_letter(own[o], latest.get(o)) for o in origins if o in own]
    if reason is not None:
        listed = [d for d in listed if d.reason.startswith(reason)]
    return listed[:limit]


def redrives_of(key: str) -> Plan[list[RedriveLink]]:
    """Every re-drive of the request under ``key`` (or of the origin of the re-drive ``key``), oldest
    first, each with its outcome's status."""
    origin = yield from _origin(valid.idempotency_key(key))
    found: Rows = yield (
        sa.select(request_redrives, request_outcomes.c.status)
        .select_from(
            request_redrives.outerjoin(
                request_outcomes, request_outcomes.c.key == request_redrives.c.redrive_key
            )
        )
        .where(request_redrives.c.origin_key == origin)
        .order_by(request_redrives.c.number)
    )
    return [_link(row, row.status) for row in found.rows]


def _origin(key: str) -> Plan[str]:
    found: Rows = yield sa.select(request_redrives.c.origin_key).where(request_redrives.c.redrive_key == key)
    row = found.first()
    return key if row is None else str(row.origin_key)


def claim(key: str, *, by: str | None = None, dry_run: bool = False) -> Plan[Redrive]:
    """Claim the next re-drive of the dead-lettered request under ``key`` (or of the origin of the
    re-drive ``key``): checked and recorded in one transaction, :class:`RedriveRefused` or
    :class:`UnknownRequest` with nothing written otherwise. ``dry_run``: the same checks, nothing recorded.
    The caller sends the returned request, or :func:`drop` s the claim when it cannot."""
    valid.idempotency_key(key)
    valid.name(by, field="by", max_chars=valid.MAX_WORKER_CHARS)
    try:
        claimed: Redrive = yield Atomic(_claim(key, by, dry_run))
    except KeyTaken as taken:
        if taken.where != "redrive":
            raise
        # Another claim of the same number (or key) committed first.
        raise RedriveRefused(key=key, why="it is being re-driven by someone else right now") from None
    return claimed


def _claim(key: str, by: str | None, dry_run: bool) -> Plan[Redrive]:
    origin = yield from _origin(key)
    found: Rows = yield sa.select(request_outcomes).where(request_outcomes.c.key == origin)
    row = found.first()
    if row is None:
        raise UnknownRequest(origin)
    dead = result_of(row)
    if dead.status != DEAD:
        raise RedriveRefused(key=origin, why=f"it ended {dead.status}, not dead_lettered")
    kind, arguments = _carried(dead)
    if kind is None or arguments is None:
        raise RedriveRefused(
            key=origin, why="its dead letter does not record the request's arguments (written by older code)"
        )
    latest = (yield from _latest_links([origin])).get(origin)
    if latest is not None and latest.status is None:
        raise RedriveRefused(key=origin, why=f"its re-drive {latest.key} has no final outcome yet")
    if latest is not None and latest.status != DEAD:
        raise RedriveRefused(key=origin, why=f"it was re-driven already: {latest.key} ended {latest.status}")
    number = 1 if latest is None else latest.number + 1
    if number > MAX_REDRIVE_NUMBER:
        raise RedriveRefused(key=origin, why=f"it was re-driven {MAX_REDRIVE_NUMBER} times")
    new_key = redrive_key(origin, number)
    taken: Rows = yield sa.select(request_outcomes.c.fingerprint).where(request_outcomes.c.key == new_key)
    other = taken.first()
    if other is not None and other.fingerprint != dead.fingerprint:
        # A request of someone else's already uses the key this re-drive would take.
        raise RedriveRefused(key=origin, why=f"the key {new_key} names a different request")
    if not dry_run:
        yield sa.insert(request_redrives).values(
            redrive_key=new_key,
            origin_key=origin,
            number=number,
            operation=dead.operation,
            at_ms=db_now_ms(),
            by=by,
        )
    return Redrive(origin=origin, key=new_key, number=number, request_type=kind, arguments=arguments, by=by)


def drop(redrive_key: str) -> Plan[bool]:
    """Take back a claimed re-drive that could not be sent: its link goes while its key has no outcome
    (a re-drive that ran keeps its link). True when it went."""
    ran = sa.exists().where(request_outcomes.c.key == valid.idempotency_key(redrive_key))
    gone: Rows = yield Alone(
        sa.delete(request_redrives)
        .where(request_redrives.c.redrive_key == redrive_key, ~ran)
        .returning(request_redrives.c.redrive_key)
    )
    return bool(gone.rows)
