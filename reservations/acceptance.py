"""The record of every request handed to the broker, written by every producer before it publishes: the
database holds the request, the broker only carries it (why: docs/architecture.md, "Why a record per
request"). The relay (tasks.relay) looks at each record whose ``next_look_ms`` has come, and publishes it
again, or ends it, until it has its outcome.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert

from fencing.plan import Alone, Plan
from fencing.sql import Rows, db_now_ms
from reservations import validation as valid
from reservations.errors import InvalidRequest
from reservations.models import accepted_requests, pending_reservations, request_outcomes, task_attempts
from reservations.request_outcomes import RequestResult, record_outcome, request_outcome
from reservations.statuses import RequestStatus
from reservations.values import seconds

_T = accepted_requests


@dataclass(frozen=True, slots=True)
class Request:
    """A request as its producer records it before publishing: ``request_type`` and ``arguments`` are
    what a message of ``message_format`` carries (the idempotency key apart), ``operation`` and
    ``fingerprint`` what its outcome will name; ``caller`` is the caller's space (None: the operator's);
    ``deadline`` in seconds since the epoch; ``sku_hint``: the SKU of the reservation a confirm or release
    names, when its producer knows it, which its message carries for the worker's lease and its record
    does not keep (a copy published again from the record goes without it)."""

    key: str
    request_type: str
    operation: str
    arguments: Mapping[str, Any]
    fingerprint: str
    task_id: str
    message_format: int
    deadline: float | None = None
    caller: str | None = None
    sku_hint: str | None = None

    def values(self, look_after: float) -> dict[str, Any]:
        """The record's columns; the relay first looks at it ``look_after`` seconds from now."""
        return {**self.given(), **_clock(round(look_after * 1000))}

    def given(self) -> dict[str, Any]:
        """The record's columns that come from the request, checked; the clock's are the database's."""
        return {
            "key": valid.idempotency_key(self.key),
            "operation": valid.operation(self.operation),
            "fingerprint": self.fingerprint,
            "deadline_ms": None if self.deadline is None else round(self.deadline * 1000),
            "caller": self.caller,
            "request_type": valid.operation(self.request_type),
            "arguments": valid.stored_json(self.arguments, "arguments"),
            "task_id": self.task_id,
            "message_format": self.message_format,
            "publishes": 1,
        }


def _clock(look_ms: int | sa.ColumnElement[int]) -> dict[str, sa.ColumnElement[int]]:
    """A record's columns from the database's clock: accepted now, first looked at by the relay
    ``look_ms`` milliseconds from now (a number, or the bound value of a statement built once)."""
    return {"at_ms": db_now_ms(), "next_look_ms": db_now_ms() + look_ms}


@dataclass(frozen=True, slots=True)
class Accepted:
    """A request recorded under ``key``: what it is, when it was accepted and its deadline (seconds since
    the epoch, database clock for ``at``), and how the relay stands with it: ``publishes`` (the first
    publication counts) and ``next_look`` (None: the relay looks at it no more). ``arguments`` is None
    on records older than arguments."""

    key: str
    operation: str
    fingerprint: str
    at: float
    deadline: float | None
    caller: str | None = None
    request_type: str | None = None
    arguments: dict[str, Any] | None = None
    task_id: str | None = None
    message_format: int | None = None
    publishes: int = 0
    next_look: float | None = None

    def names(self, operation: str, fingerprint: str) -> bool:
        """Whether this record is of the request with this operation and fingerprint."""
        return self.operation == operation and self.fingerprint == fingerprint

    def request(self) -> Request:
        """The request as it was recorded, to publish it again; a record older than its arguments has
        none to publish (ValueError)."""
        fields = {name: getattr(self, name) for name in Request.__dataclass_fields__ if name != "sku_hint"}
        if None in (self.request_type, self.arguments, self.task_id, self.message_format):
            raise ValueError(f"the record of {self.key!r} holds no arguments to publish")
        return Request(**fields)


@dataclass(frozen=True, slots=True)
class Admission:
    """What the key holds when a request arrives under it: its final ``outcome`` (then nothing was
    recorded), or the ``accepted`` record, which is this request's own when ``first``."""

    outcome: RequestResult | None
    accepted: Accepted | None
    first: bool


_ACCEPTED = sa.select(_T).where(_T.c.key == sa.bindparam("key"))
_LEARNED = ("request_type", "arguments", "task_id", "message_format")


def _accepted_of(row: Any) -> Accepted:
    fields = row._asdict()
    return Accepted(
        at=fields.pop("at_ms") / 1000,
        deadline=seconds(fields.pop("deadline_ms")),
        next_look=seconds(fields.pop("next_look_ms")),
        **{**fields, "arguments": None if row.arguments is None else json.loads(row.arguments)},
    )


def admit(request: Request, look_after: float) -> Plan[Admission]:
    """Record ``request`` under its key unless the key has an outcome or a record already: one statement
    for a new key, the front door's every first request. Otherwise the key's outcome, or the request
    recorded first under it, read after."""
    given = request.given()
    made: Rows = yield Alone(_admission(tuple(given)), {**given, "look_ms": round(look_after * 1000)})
    if made.rows:
        return Admission(outcome=None, accepted=_accepted_of(made.rows[0]), first=True)
    outcome = yield from request_outcome(request.key)
    if outcome is not None:
        return Admission(outcome=outcome, accepted=None, first=False)
    found: Rows = yield Alone(_ACCEPTED, {"key": request.key})
    row = found.first()
    if row is None:  # purged between the statements: this request may take the key after all
        return (yield from admit(request, look_after))
    return Admission(outcome=None, accepted=_accepted_of(row), first=False)


def admit_many(requests: Sequence[Request], look_after: float, *, arrays: bool) -> Plan[list[Admission]]:
    """Admit each of ``requests`` as :func:`admit` does, in order: what the front door's publishing thread
    does with the requests that arrived while it was busy. With ``arrays`` (PostgreSQL) every new key is
    recorded by one statement built once, each column's values sent as one array; a key met before is read
    after, as :func:`admit` reads it. The same key twice in ``requests`` is admitted first for the first,
    and the second finds that record. Without ``arrays`` (SQLite) each request is admitted in turn."""
    admitted: list[Admission] = []
    if not arrays or len(requests) == 1:
        for request in requests:
            admitted.append((yield from admit(request, look_after)))
        return admitted
    columns, values = _arrays(requests, look_after)
    made: Rows = yield Alone(_unnested(columns, admitting=True), values)
    new = {row.key: _accepted_of(row) for row in made.rows}
    firsts: set[str] = set()
    for request in requests:
        record = new.get(request.key)
        if record is None:
            admitted.append((yield from admit(request, look_after)))
        else:
            admitted.append(Admission(outcome=None, accepted=record, first=request.key not in firsts))
            firsts.add(request.key)
    return admitted


def _arrays(requests: Sequence[Request], look_after: float) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The records of ``requests`` as :func:`_unnested` sends them: their columns, and each column's
    values as one array (with the relay's first look)."""
    given = [request.given() for request in requests]
    columns = tuple(given[0])
    values = {name: [row[name] for row in given] for name in columns}
    return columns, {**values, "look_ms": round(look_after * 1000)}


@cache
def _unnested(columns: tuple[str, ...], *, admitting: bool) -> sa.Insert:
    """The records of many requests in one statement on PostgreSQL: the rows are the arrays of ``columns``
    (bound values of their own names) unnested side by side, so the text is the same whatever the batch's
    size and the driver prepares it once (a statement of a row of values each is compiled anew for every
    batch: half a producer's CPU). Unnesting keeps the arrays' order, and ``ON CONFLICT DO NOTHING``
    keeps the first row of a key sent twice. Text goes as ``text[]``: a cast to ``varchar(n)`` would cut
    a value too long, where the insert refuses it. ``admitting``: as :func:`_admission`, nothing for a
    key with an outcome, and the rows made returned."""
    arrays = [sa.cast(sa.bindparam(name), ARRAY(_unbounded(_T.c[name].type))) for name in columns]
    rows = sa.func.unnest(*arrays).table_valued(*columns).render_derived(name="given")
    clock = _clock(sa.bindparam("look_ms", type_=sa.BigInteger))
    chosen = sa.select(*(rows.c[name] for name in columns), *clock.values())
    if admitting:
        chosen = chosen.where(~sa.exists().where(request_outcomes.c.key == rows.c.key))
    insert = (
        pg_insert(_T)
        .from_select([*columns, *clock], chosen)
        .on_conflict_do_nothing(index_elements=[_T.c.key])
    )
    return insert.returning(*_T.c) if admitting else insert


def _unbounded(type_: Any) -> Any:
    return type_ if isinstance(type_, sa.Integer) else sa.Text()


@cache
def _admission(columns: tuple[str, ...]) -> sa.Insert:
    """INSERT .. SELECT of a record from bound values (``columns``) and the database's clock, only where
    the key has no outcome, and nothing where it has a record (``ON CONFLICT DO NOTHING``: the same text
    on PostgreSQL and SQLite, whose upsert wants the WHERE the SELECT has). It returns the row it made, so
    no row back means the key was met before. Built once: the front door sends it for every request, and
    building it cost a quarter of its time."""
    row = _bound(columns)
    decided = sa.exists().where(request_outcomes.c.key == sa.bindparam("key"))
    return (
        pg_insert(_T)
        .from_select(list(row), sa.select(*row.values()).where(~decided))
        .on_conflict_do_nothing(index_elements=[_T.c.key])
        .returning(*_T.c)
    )


# The requests one statement records at most: a record is a dozen bound values, and a statement takes at
# most 65,535 of them on PostgreSQL and 32,766 on SQLite. A burst of 10,000 enqueues awaited at once is
# one batch of the publishing thread (tasks.outbox.Outbox).
RECORDED_PER_STATEMENT = 1000


def record(batch: Sequence[Request], look_after: float, *, arrays: bool) -> Plan[None]:
    """Record the requests of ``batch``, all of them or none. A key recorded already keeps its first record
    (a second request under it is the same request, or a conflict its worker reports). With ``arrays``
    (PostgreSQL) one statement built once records any batch (:func:`_unnested`); without (SQLite) one
    statement in autocommit for up to RECORDED_PER_STATEMENT requests, and beyond that a statement per so
    many in one transaction. ``ON CONFLICT DO NOTHING`` is the same text on PostgreSQL and SQLite."""
    if len(batch) == 1:  # a producer's every single enqueue: the statement built once
        given = batch[0].given()
        yield Alone(_recording(tuple(given)), {**given, "look_ms": round(look_after * 1000)})
        return
    if arrays:
        columns, values = _arrays(batch, look_after)
        yield Alone(_unnested(columns, admitting=False), values)
        return
    rows = [request.values(look_after) for request in batch]
    chunks = [rows[i : i + RECORDED_PER_STATEMENT] for i in range(0, len(rows), RECORDED_PER_STATEMENT)]
    for chunk in chunks:
        insert = pg_insert(_T).values(chunk).on_conflict_do_nothing(index_elements=[_T.c.key])
        yield Alone(insert) if len(chunks) == 1 else insert


@cache
def _recording(columns: tuple[str, ...]) -> sa.Insert:
    """INSERT of one record from bound values (``columns``) and the database's clock that keeps a key's
    first record. Built once, as :func:`_admission` is: a statement of literal values is compiled anew
    on every call, about a millisecond of the producer's CPU per request."""
    return pg_insert(_T).values(_bound(columns)).on_conflict_do_nothing(index_elements=[_T.c.key])


def _bound(columns: tuple[str, ...]) -> dict[str, sa.ColumnElement[Any]]:
    """A record's columns as the statements built once send them: ``columns`` as bound values of their
    own names, and the database's clock with the relay's first look ``look_ms`` (bound) from now."""
    row: dict[str, sa.ColumnElement[Any]] = {
        name: sa.bindparam(name, type_=_T.c[name].type) for name in columns
    }
    return {**row, **_clock(sa.bindparam("look_ms", type_=sa.BigInteger))}


def accepted(key: str) -> Plan[Accepted | None]:
    """The request recorded under ``key``, or None."""
    found: Rows = yield Alone(_ACCEPTED, {"key": valid.idempotency_key(key)})
    row = found.first()
    return None if row is None else _accepted_of(row)


def cancel(key: str, *, by: str, reason: str) -> Plan[RequestResult]:
    """End the recorded request under ``key`` ``cancelled``, touching no stock, unless it is decided
    already: the key's own records decide, first wins. Its outcome row and a tombstone in its idempotency
    record commit together (request_outcomes.NO_EFFECT), so a worker carrying a copy later replays
    "closed" instead of applying it, and a worker that applied it first keeps its outcome. Returns the
    key's outcome: ``cancelled`` by this call, or whatever was stored first; AlreadyApplied when a worker
    applied it and has not recorded its outcome yet."""
    record = yield from accepted(key)
    if record is None:
        raise InvalidRequest(f"no request is recorded under {key!r}", field="key")
    detail = {"reason": valid.text(reason, field="reason", max_chars=valid.MAX_REASON_CHARS), "by": by}
    result: RequestResult = yield from record_outcome(
        key, record.operation, RequestStatus.CANCELLED, detail, fingerprint=record.fingerprint
    )
    return result


# -- the relay's side ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Due:
    """A record whose look has come: whether its request has an outcome already (``ended``), and
    whether it waits in its hot SKU's queue for the lease holder (``queued``: the database carries it,
    not the broker)."""

    accepted: Accepted
    ended: bool
    queued: bool


def due(limit: int, hold: float) -> Plan[list[Due]]:
    """Claim up to ``limit`` records whose look has come, oldest look first, moving their next look
    ``hold`` seconds on (so a relay that dies meanwhile leaves them to the next): two relays claim
    disjoint records (``SKIP LOCKED`` on PostgreSQL; SQLite runs one writer at a time)."""
    now = db_now_ms()
    claimable = (
        sa.select(_T.c.key)
        .where(_T.c.next_look_ms <= now)
        .order_by(_T.c.next_look_ms)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    claimed: Rows = yield Alone(
        sa.update(_T)
        .where(_T.c.key.in_(claimable.scalar_subquery()))
        .values(next_look_ms=now + round(hold * 1000))
        .returning(*_T.c)
    )
    if not claimed.rows:
        return []
    keys = [row.key for row in claimed.rows]
    states: Rows = yield Alone(
        sa.union_all(
            sa.select(request_outcomes.c.key, sa.literal("ended").label("state")).where(
                request_outcomes.c.key.in_(keys)
            ),
            sa.select(pending_reservations.c.key, sa.literal("queued").label("state")).where(
                pending_reservations.c.key.in_(keys)
            ),
        )
    )
    ended = {row.key for row in states.rows if row.state == "ended"}
    queued = {row.key for row in states.rows if row.state == "queued"}
    return [Due(_accepted_of(row), ended=row.key in ended, queued=row.key in queued) for row in claimed.rows]


def republished(keys: Sequence[str], spacing: Sequence[float]) -> Plan[None]:
    """Count one more publication of each of ``keys``, each next looked at after ``spacing[n]`` seconds,
    ``n`` its publications before this one (the last spacing for any more)."""
    if not keys:
        return
    looks = {n: round(seconds * 1000) for n, seconds in enumerate(spacing)}
    after = sa.case(looks, value=_T.c.publishes, else_=looks[len(spacing) - 1])
    yield Alone(
        sa.update(_T)
        .where(_T.c.key.in_(list(keys)))
        .values(publishes=_T.c.publishes + 1, next_look_ms=db_now_ms() + after)
    )


def later(keys: Sequence[str], seconds: float | None) -> Plan[None]:
    """Look at ``keys`` again ``seconds`` from now (their messages are still carried); None: never."""
    if keys:
        next_look = None if seconds is None else db_now_ms() + round(seconds * 1000)
        yield Alone(sa.update(_T).where(_T.c.key.in_(list(keys))).values(next_look_ms=next_look))


def closed(keys: Sequence[str]) -> Plan[None]:
    """The relay looks at ``keys`` no more: each has its outcome."""
    return later(keys, None)


def keep(request: Request, look_after: float) -> Plan[None]:
    """Make sure the relay carries ``request`` on: record it if it is not (a message of a producer that
    recorded nothing), and have its record looked at within ``look_after`` seconds. For a worker that
    cannot hand the request back to the broker (a retry the broker refused) before it lets the message go:
    nothing is acked without a record the relay acts on."""
    values = request.values(look_after)
    insert = pg_insert(_T).values(values)
    yield Alone(
        insert.on_conflict_do_update(
            index_elements=[_T.c.key],
            set_={
                "next_look_ms": insert.excluded.next_look_ms,
                # A record older than its arguments learns them from the message.
                **{c: sa.func.coalesce(_T.c[c], insert.excluded[c]) for c in _LEARNED},
            },
        )
    )


def unfinished() -> Plan[tuple[int, float | None]]:
    """How many recorded requests have no outcome yet, and the age in seconds of the oldest of them (the
    database's clock): what an operator's alert on stuck requests reads. A record the relay has not closed
    yet but whose outcome exists is finished."""
    open_records = (
        sa.select(sa.func.count(), sa.func.min(_T.c.at_ms), db_now_ms())
        .select_from(_T.outerjoin(request_outcomes, request_outcomes.c.key == _T.c.key))
        .where(_T.c.next_look_ms.is_not(None), request_outcomes.c.key.is_(None))
    )
    found: Rows = yield Alone(open_records)
    count, oldest, now = found.rows[0]
    return int(count), None if oldest is None else max(0.0, (now - oldest) / 1000)


# -- browsing the recorded requests ----------------------------------------------------------------------

# The states of a recorded request without an outcome: nobody made an attempt at it yet (queued, or lost
# and about to be published again), or a worker did and it retries. With an outcome, its status.
PENDING, RETRYING = "pending", "retrying"
# Views over those: every request without an outcome, and those of them older than a bound.
IN_FLIGHT, STUCK = "in-flight", "stuck"
VIEWS = (PENDING, RETRYING, IN_FLIGHT, STUCK)
MAX_LISTED = 10_000


@dataclass(frozen=True)
class Listed:
    """One recorded request as a list shows it: its state (an outcome's status, else pending or
    retrying), when it was accepted and ended (seconds since the epoch), its attempts and publications."""

    key: str
    operation: str
    caller: str | None
    state: str
    accepted_at: float
    ended_at: float | None
    attempts: int
    publishes: int
    deadline: float | None


def listed(
    *,
    state: str | None = None,
    operation: str | None = None,
    since_ms: int | None = None,
    stuck_after: float = 600.0,
    after: str | None = None,
    limit: int = 100,
) -> Plan[list[Listed]]:
    """Recorded requests, newest accepted first, at most ``limit``: those in ``state`` (an outcome's
    status, or one of VIEWS; STUCK is without an outcome ``stuck_after`` seconds after its acceptance,
    by the database's clock), of ``operation``, accepted since ``since_ms``; after the key ``after`` (the
    last of the previous page). Each row's attempts are counted by key through the attempts' index."""
    valid.limit(limit, maximum=MAX_LISTED)
    outcome = request_outcomes
    tried = sa.select(task_attempts.c.key).where(task_attempts.c.key == _T.c.key).exists()
    attempts = sa.select(sa.func.count()).where(task_attempts.c.key == _T.c.key).scalar_subquery()
    open_ = outcome.c.key.is_(None)
    query = (
        sa.select(
            _T.c.key,
            _T.c.operation,
            _T.c.caller,
            outcome.c.status,
            _T.c.at_ms,
            outcome.c.at_ms,
            attempts,
            _T.c.publishes,
            _T.c.deadline_ms,
        )
        .select_from(_T.outerjoin(outcome, outcome.c.key == _T.c.key))
        .order_by(_T.c.at_ms.desc(), _T.c.key.desc())
        .limit(limit)
    )
    stuck = _T.c.at_ms < db_now_ms() - round(stuck_after * 1000)
    views = {PENDING: (open_, ~tried), RETRYING: (open_, tried), IN_FLIGHT: (open_,), STUCK: (open_, stuck)}
    if state in views:
        query = query.where(*views[state])
    elif state is not None:
        if state not in set(RequestStatus):
            known = ", ".join([*VIEWS, *sorted(RequestStatus)])
            raise InvalidRequest(f"unknown state {state!r}: one of {known}", field="state")
        query = query.where(outcome.c.status == state)
    if operation is not None:
        query = query.where(_T.c.operation == operation)
    if since_ms is not None:
        query = query.where(_T.c.at_ms >= since_ms)
    if after is not None:
        mark = sa.select(_T.c.at_ms).where(_T.c.key == valid.idempotency_key(after)).scalar_subquery()
        query = query.where(sa.tuple_(_T.c.at_ms, _T.c.key) < sa.tuple_(mark, after))
    found: Rows = yield Alone(query)
    return [
        Listed(
            key=key,
            operation=op,
            caller=caller,
            state=status if status is not None else (RETRYING if tries else PENDING),
            accepted_at=at / 1000,
            ended_at=seconds(ended),
            attempts=int(tries),
            publishes=int(publishes),
            deadline=seconds(deadline),
        )
        for key, op, caller, status, at, ended, tries, publishes, deadline in found.rows
    ]
