"""Requests as the queue sees them: the one final outcome per idempotency key, and the attempts behind it.

The stock change itself is made idempotent by :mod:`reservations.operations`; this module records what
a caller waits for. The first final outcome written for a key wins; later writers get it back.

A dead-lettered key driven again reports its latest re-drive's outcome (:class:`Redriven`, :func:`_followed`;
docs/architecture.md, "Dead letters driven again").
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

from fencing.plan import Alone, Atomic, Plan
from fencing.sql import Rows, db_now_ms
from reservations import sql_text
from reservations import validation as valid
from reservations.collisions import KeptColliding, rounds
from reservations.errors import InvalidRequest
from reservations.ledger import TOMBSTONE_FINGERPRINT, closed, one, records
from reservations.models import (
    HELD,
    accepted_requests,
    idempotency_keys,
    request_outcomes,
    request_redrives,
    reservations,
    task_attempts,
)
from reservations.statuses import AttemptResult, RequestStatus
from reservations.values import Outcome, columns

# Idempotency records, and request outcomes and attempts, are kept this long by default;
# ``purge_idempotency`` and :func:`purge` delete older ones. A retry or redelivery arriving after its key was
# purged would be applied again, so keep this well above the broker's redelivery horizon (visibility
# timeout plus the longest retry backoff).
DEFAULT_IDEMPOTENCY_RETENTION = 7 * 24 * 3600.0

FINAL_STATUSES = tuple(RequestStatus)
ATTEMPT_RESULTS = tuple(AttemptResult)


# Outcomes and attempts have one writer each: the plans insert them with :func:`outcomes_written` and
# :func:`attempts_written`, and the one-statement writes on PostgreSQL embed the INSERTs below, each from
# the rows of its CTEs (the speaker's task, worker and epochs are parameters).
_INTO = {
    "told": "INSERT INTO request_outcomes"
    " (key, operation, status, detail, task_id, worker, epochs, at_ms, fingerprint)",
    "tried": "INSERT INTO task_attempts (key, operation, result, task_id, worker, token, detail, at_ms)",
    "speaker": "%(task_id)s::text, %(worker)s::text, %(epochs)s::int, now_ms, %(fingerprint)s::text",
}
# Applied (reserve_statement, keyed_statement): from ``upd``, the stock row after the write and now_ms, the
# outcome detailed as Outcome.summary, then ``short``'s rows (a reservation's refusal, or none).
_TOLD = """{told}
    SELECT %(key)s::text, {operation}, {status},
           json_build_object(
               'reservation_ids', {reservation_ids}, 'token', %(token)s::bigint, 'quantity', {quantity},
               'stock', json_build_array(json_build_object(
                   'sku', sku, 'on_hand', on_hand, 'reserved', reserved, 'available', available)))::text,
           {speaker}
    FROM upd WHERE %(record)s::boolean{short}"""
# A reservation short of units: from ``cur``, the row it locked.
_TOLD_SHORT = """
    UNION ALL
    SELECT %(key)s::text, 'reserve', 'insufficient_stock',
           json_build_object('sku', sku, 'requested', %(quantity)s::bigint, 'available', available)::text,
           {speaker}
    FROM cur WHERE %(record)s::boolean AND cur.accepted AND NOT cur.enough"""
_TRIED = """{tried}
    SELECT %(key)s::text, {operation}, 'applied', %(task_id)s::text, %(worker)s::text,
           %(token)s::bigint, NULL, now_ms
    FROM upd WHERE %(record)s::boolean"""
# A batch's outcomes and attempts (batch_statement), as the batch decided them (JSON arrays of the rows of
# :func:`outcomes_written` and :func:`attempts_written`).
_BATCH_TOLD = """{told}
    SELECT o.key, o.operation, o.status, o.detail, o.task_id, o.worker, o.epochs, c.now_ms, o.fingerprint
    FROM json_to_recordset(%(outcomes)s::json)
         AS o(key text, operation text, status text, detail text, task_id text, worker text, epochs int,
              fingerprint text),
         clock AS c, ok
    WHERE ok.ok
    RETURNING *"""
_BATCH_TRIED = """{tried}
    SELECT a.key, a.operation, a.result, a.task_id, a.worker, a.token, a.detail, c.now_ms
    FROM json_to_recordset(%(attempts)s::json)
         AS a(key text, operation text, result text, task_id text, worker text, token bigint, detail text),
         clock AS c, ok
    WHERE ok.ok"""
BATCH_TOLD = _BATCH_TOLD.format(**_INTO)
BATCH_TRIED = _BATCH_TRIED.format(**_INTO)
# The request's final outcome, as a statement speaking for it reads it first.
DONE = (
    "SELECT key, operation, status, detail, task_id, worker, epochs, at_ms, fingerprint FROM request_outcomes"
    " WHERE %(record)s::boolean AND key = %(key)s::text"
)


def told(known: dict[str, str], *, short: bool = False) -> str:
    """The outcome of an applied write (and with ``short``, of a reservation refused for lack of units),
    ``known``: the operation, status, reservation ids and quantity as the statement knows them in SQL."""
    refusal = _TOLD_SHORT.format(**_INTO) if short else ""
    return _TOLD.format(**_INTO, **known, short=refusal)


def tried(operation: str) -> str:
    """The applied attempt of a write whose ``operation`` the statement knows as SQL."""
    return _TRIED.format(**_INTO, operation=operation)


def outcomes_written(*rows: dict[str, Any]) -> sa.Insert:
    """Insert the outcomes ``rows``, at the database's time."""
    return sql_text.stamped(request_outcomes, "at_ms", rows)


def attempts_written(*rows: dict[str, Any]) -> sa.Insert:
    """Insert the attempts ``rows``, at the database's time."""
    return sql_text.stamped(task_attempts, "at_ms", rows)


_REQUEST_NAMESPACE = uuid.UUID("6f1c3f0e-4a57-4d1e-9a43-2f3b0c9d7e11")


def request_id(key: str) -> str:
    """The queue's id for the request with this idempotency key: the same key always names one request."""
    return str(uuid.uuid5(_REQUEST_NAMESPACE, valid.idempotency_key(key)))


@dataclass(frozen=True, slots=True)
class Redriven:
    """Where a reported outcome came from when the key's request was dead-lettered and driven again: the
    latest re-drive's key and number, when and by whom it was asked for, and whether it has ended
    (``final``; until then the key reports its dead letter, with this attached)."""

    key: str
    number: int
    at: float
    by: str | None
    final: bool


@dataclass(frozen=True, slots=True)
class RequestResult:
    key: str
    operation: str
    status: str
    detail: dict[str, Any]
    task_id: str | None
    worker: str | None
    epochs: int
    at: float
    # The fingerprint of the request this outcome belongs to (None on outcomes older than fingerprints).
    fingerprint: str | None = None
    # Set when the key's request was dead-lettered and driven again: the outcome is the re-drive's.
    redrive: Redriven | None = None

    def belongs_to(self, operation: str, fingerprint: str) -> bool:
        """Whether this is the outcome of the request with this operation and fingerprint, rather than of
        a different request that used the same key first."""
        if self.fingerprint is None:
            return self.operation == operation
        return self.fingerprint == fingerprint


@dataclass(frozen=True, slots=True)
class RequestReply:
    """A request run to its end: its stored final outcome, and the stock change when this run made or
    replayed one (None when the request had already ended, or ended without a change)."""

    result: RequestResult
    outcome: Outcome | None


@dataclass(frozen=True, slots=True)
class Attempt:
    key: str
    operation: str
    task_id: str | None
    worker: str | None
    token: int | None
    result: str
    detail: str | None
    at: float


def result_from_json(text: str) -> RequestResult:
    """An outcome row sent as ``row_to_json`` by a one-statement path (a column each costs the client)."""
    return result_of(SimpleNamespace(**json.loads(text)))


def result_of(row: Any) -> RequestResult:
    return RequestResult(
        row.key, row.operation, row.status, json.loads(row.detail), row.task_id, row.worker, row.epochs,
        row.at_ms / 1000, row.fingerprint,
    )  # fmt: skip


# Built once: asked by every waiting caller's poll.
_OUTCOME = sa.select(request_outcomes).where(request_outcomes.c.key == sa.bindparam("key"))


def request_outcome(key: str) -> Plan[RequestResult | None]:
    """The outcome the key reports: its own, or its latest re-drive's when it was dead-lettered and driven
    again."""
    own = yield from own_outcome(key)
    if own is None:
        return None
    reported = yield from _followed({own.key: own})
    return reported[own.key]


# Holders' tasks looked up by one outcomes_for_tokens (one IN list).
MAX_TASKS_READ = 1_000


class detail_sku(FunctionElement[str]):
    """The ``sku`` an outcome's JSON detail names at its top level (a reservation short of units), as
    each database reads JSON from text: SQLite would cast the text to a number first."""

    type = sa.Text()
    inherit_cache = True


@compiles(detail_sku, "postgresql")
def _detail_sku_pg(element: detail_sku, compiler: Any, **kw: Any) -> str:
    return "(CAST(request_outcomes.detail AS json) ->> 'sku')"


@compiles(detail_sku, "sqlite")
def _detail_sku_sqlite(element: detail_sku, compiler: Any, **kw: Any) -> str:
    return "json_extract(request_outcomes.detail, '$.sku')"


def outcomes_for_tokens(
    sku: str, task_ids: Sequence[str], *, since: float | None = None, limit: int = 1000
) -> Plan[list[RequestResult]]:
    """The final outcomes that say what a SKU's lease tokens did besides the history's writes and
    refusals, oldest first: those of the lease holders' tasks ``task_ids`` (at most
    :data:`MAX_TASKS_READ`), and the newest ``limit`` since ``since`` whose detail names the SKU, which
    record no token (a reservation short of units is answered under the SKU's lease and writes only its
    outcome). One read of what the workers already write; the table has no index on either, so it is
    scanned: an operator's read, never a worker's."""
    valid.sku(sku)
    rows = valid.limit(limit)
    starting = valid.since(since)
    tasks = list(task_ids)
    for task in tasks:
        valid.task_and_worker(task_id=task)
    if len(tasks) > MAX_TASKS_READ:
        raise InvalidRequest(f"look up at most {MAX_TASKS_READ} tasks at once", field="task_ids")
    named: sa.ColumnElement[bool] = detail_sku() == sku
    if starting is not None:
        named = sa.and_(named, request_outcomes.c.at_ms >= int(starting * 1000))
    newest = (
        sa.select(request_outcomes.c.key).where(named).order_by(request_outcomes.c.at_ms.desc()).limit(rows)
    )
    chosen: sa.ColumnElement[bool] = request_outcomes.c.key.in_(newest.correlate(None).scalar_subquery())
    if tasks:
        chosen = sa.or_(chosen, request_outcomes.c.task_id.in_(tasks))
    found: Rows = yield sa.select(request_outcomes).where(chosen).order_by(request_outcomes.c.at_ms)
    return [result_of(row) for row in found.rows]


def own_outcome(key: str) -> Plan[RequestResult | None]:
    """The outcome row written under the key itself, never followed to a re-drive."""
    # Alone: one round trip on PostgreSQL (no BEGIN/COMMIT around a single read).
    found: Rows = yield Alone(_OUTCOME, {"key": valid.idempotency_key(key)})
    row = found.first()
    return None if row is None else result_of(row)


_REDRIVES_OF = (
    sa.select(request_redrives)
    .where(request_redrives.c.origin_key.in_(sa.bindparam("keys", expanding=True)))
    .order_by(request_redrives.c.origin_key, request_redrives.c.number)
)


def _followed(results: dict[str, RequestResult]) -> Plan[dict[str, RequestResult]]:
    """``results`` with each dead letter that was driven again replaced by what its latest re-drive
    reports: that re-drive's outcome once it has one, else the dead letter marked as being re-driven."""
    dead = [key for key, result in results.items() if result.status == RequestStatus.DEAD_LETTERED]
    if not dead:
        return results
    links: Rows = yield Alone(_REDRIVES_OF, {"keys": dead})
    latest = {row.origin_key: row for row in links.rows}  # ordered by number: the last one wins
    if not latest:
        return results
    found: Rows = yield Alone(_OUTCOMES, {"keys": [link.redrive_key for link in latest.values()]})
    ended = {row.key: result_of(row) for row in found.rows}
    reported = dict(results)
    for origin, link in latest.items():
        reported[origin] = reported_through(results[origin], link, ended.get(link.redrive_key))
    return reported


def reported_through(dead: RequestResult, link: Any, redrive: RequestResult | None) -> RequestResult:
    """What a dead-lettered key reports through its re-drive ``link`` (a ``request_redrives`` row):
    ``redrive``'s outcome, under the key, operation and fingerprint of the request it drove again."""
    via = Redriven(
        key=link.redrive_key, number=link.number, at=link.at_ms / 1000, by=link.by, final=redrive is not None
    )
    if redrive is None:
        return dataclasses.replace(dead, redrive=via)
    return dataclasses.replace(redrive, key=dead.key, fingerprint=dead.fingerprint, redrive=via)


_OUTCOMES = sa.select(request_outcomes).where(
    request_outcomes.c.key.in_(sa.bindparam("keys", expanding=True))
)
# PostgreSQL: the keys as one array parameter. An expanding IN is a statement of its own for each number
# of keys, rendered and converted by the client every time (about 10 ms of its CPU for 1,000 keys, on
# the event loop of whoever waits for them); this one is the same statement whatever the keys.
_OUTCOMES_ANY = sa.select(request_outcomes).where(
    request_outcomes.c.key == sa.any_(sa.bindparam("keys", type_=ARRAY(sa.String)))
)
MAX_KEYS_PER_READ = 1000


def outcomes_of(keys: Sequence[str], *, array: bool = False) -> Plan[dict[str, RequestResult]]:
    """The final outcomes of those of ``keys`` that have one, in one read (at most
    :data:`MAX_KEYS_PER_READ` keys): what a client waiting on many requests asks each time it looks.
    ``array``: send the keys as one array (PostgreSQL)."""
    if len(keys) > MAX_KEYS_PER_READ:
        raise InvalidRequest(f"at most {MAX_KEYS_PER_READ} keys per read", field="keys")
    checked = [valid.idempotency_key(key) for key in keys]
    if not checked:
        return {}
    found: Rows = yield Alone(_OUTCOMES_ANY if array else _OUTCOMES, {"keys": checked})
    reported: dict[str, RequestResult] = yield from _followed({row.key: result_of(row) for row in found.rows})
    return reported


# Outcomes that end a request without any stock change. Recording one also closes the key for good: a
# tombstone in the idempotency records makes a copy of the request still in flight (a redelivery, a
# duplicate enqueue) replay "closed" instead of applying late, and whichever commits first wins.
NO_EFFECT = (
    RequestStatus.INVALID,
    RequestStatus.DEAD_LETTERED,
    RequestStatus.EXPIRED,
    RequestStatus.CANCELLED,
)


class AlreadyApplied(Exception):
    """The key was decided after all (applied, or refused for lack of stock): its final outcome is that
    decision, not this refusal."""


def _insert_outcome(values: dict[str, Any]) -> Plan[RequestResult]:
    found: Rows = yield sa.select(request_outcomes).where(request_outcomes.c.key == values["key"])
    row = found.first()
    if row is not None:
        return result_of(row)
    if values["status"] in NO_EFFECT:
        decided: Rows = yield sa.select(idempotency_keys.c.fingerprint).where(
            idempotency_keys.c.key == values["key"]
        )
        record = decided.first()
        if record is not None and record.fingerprint != TOMBSTONE_FINGERPRINT:
            # A request under this key was applied or refused, and writes that outcome itself.
            raise AlreadyApplied(values["key"])
        if record is None:
            yield records(closed(values["key"], values["operation"], values["status"]))
    yield outcomes_written(values)
    stored: Rows = yield sa.select(request_outcomes).where(request_outcomes.c.key == values["key"])
    return result_of(stored.rows[0])


# Who writes an outcome or an attempt: the fields and their defaults. Checked with the other arguments, so
# that no caller sends a value the database would refuse with a raw error.
_OUTCOME_FIELDS = {"task_id": None, "worker": None, "epochs": 0, "fingerprint": None}
_ATTEMPT_FIELDS = {"task_id": None, "worker": None, "token": None, "detail": None}


def _who(who: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """``who`` checked, over the defaults of ``fields``."""
    unknown = sorted(set(who) - set(fields))
    if unknown:
        raise InvalidRequest(f"unexpected field(s): {', '.join(unknown)}", field=unknown[0])
    valid.task_and_worker(who.get("task_id"), who.get("worker"))
    if "epochs" in who:
        valid.epochs(who["epochs"])
    if "fingerprint" in who:
        valid.fingerprint(who["fingerprint"])
    if "token" in who:
        valid.token(who["token"])
    if "detail" in who:
        valid.text(who["detail"], field="detail", max_chars=valid.MAX_DETAIL_CHARS)
    return {**fields, **who}


def record_outcome(
    key: str, operation: str, status: str, detail: dict[str, Any], **who: Any
) -> Plan[RequestResult]:
    """Write the request's final outcome unless one exists; return whichever is stored (compare its
    fingerprint: it may belong to a different request that used the key first). ``who``: ``task_id``,
    ``worker``, ``epochs``, ``fingerprint``."""
    valid.idempotency_key(key)
    valid.operation(operation)
    valid.detail(detail)
    written = _who(who, _OUTCOME_FIELDS)
    if status not in FINAL_STATUSES:
        raise InvalidRequest(f"unknown final status {status!r}", field="status")
    values = {"key": key, "operation": operation, "status": status, **written}
    values["detail"] = json.dumps(detail, sort_keys=True)

    # A concurrent writer that stored its outcome first fails this insert: the next round reads it back.
    for round_ in rounds():
        with round_:
            result: RequestResult = yield Atomic(_insert_outcome(values))
            return result
    raise KeptColliding(f"the outcome of {key!r}")


def record_attempt(key: str, operation: str, result: str, **who: Any) -> Plan[None]:
    """``who``: ``task_id``, ``worker``, ``token``, ``detail``."""
    valid.idempotency_key(key)
    valid.operation(operation)
    written = _who(who, _ATTEMPT_FIELDS)
    if result not in ATTEMPT_RESULTS:
        raise InvalidRequest(f"unknown attempt result {result!r}", field="result")
    yield Atomic(one(attempts_written({"key": key, "operation": operation, "result": result, **written})))


def attempts(key: str) -> Plan[list[Attempt]]:
    found: Rows = yield (
        sa.select(*(column for column in task_attempts.c if column.name != "id"))  # what an Attempt holds
        .where(task_attempts.c.key == valid.idempotency_key(key))
        .order_by(task_attempts.c.id)
    )
    return [Attempt(**columns(r)) for r in found.rows]


def skus_with_due_holds(limit: int = 1000) -> Plan[list[str]]:
    """SKUs that have held reservations past their hold (database clock): work for the expiry sweep."""
    found: Rows = yield (
        sa.select(reservations.c.sku)
        .distinct()
        .where(reservations.c.status == HELD, reservations.c.hold_expires_ms <= db_now_ms())
        .order_by(reservations.c.sku)
        .limit(valid.limit(limit))
    )
    return [r[0] for r in found.rows]


def purge(*, older_than: float = DEFAULT_IDEMPOTENCY_RETENTION) -> Plan[int]:
    """Delete request outcomes and attempts past ``older_than`` seconds (database clock), by default the
    same retention as the idempotency records."""
    purged: int = yield Atomic(_purge(round(valid.retention(older_than) * 1000)))
    return purged


def _purge(older_than_ms: int) -> Plan[int]:
    cutoff = db_now_ms() - older_than_ms
    outcomes: Rows = yield (
        sa.delete(request_outcomes).where(request_outcomes.c.at_ms < cutoff).returning(request_outcomes.c.key)
    )
    yield sa.delete(task_attempts).where(task_attempts.c.at_ms < cutoff)
    # A link goes with the outcomes it joins (a re-drive is newer than the dead letter it drove again).
    yield sa.delete(request_redrives).where(request_redrives.c.at_ms < cutoff)
    # What the front door accepted goes too: an outcome that old was purged above, and a request that
    # never reached one in the whole retention is not waited for any more.
    yield sa.delete(accepted_requests).where(accepted_requests.c.at_ms < cutoff)
    return len(outcomes.rows)
