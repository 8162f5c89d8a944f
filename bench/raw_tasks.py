"""The physical reference for a reservation task: a Celery task at Celery's defaults (the no-op baseline's
app, :mod:`bench.celery_defaults`) that takes a plain Redis lock (``SET NX PX``), writes the rows a
reservation task writes in one raw psycopg statement, and releases the lock with a compare-and-delete
script. Run as ``celery -A bench.raw_tasks worker``; the database and the lock's Redis come from
:data:`DATABASE_ENV` and :data:`LOCK_ENV`.

What it leaves out is what the project adds for safety: no fencing token (none is issued or checked),
no idempotency lookup or replay, no stock row lock, no message checks, no lease renewal, and a lock that
is found taken is simply tried again. What it keeps: the same Celery round (JSON, a result stored and
awaited), the same two Redis round trips for the lock, and one statement writing the same seven rows
(the stock counts, the reservation, its history row, the idempotency record, the request's outcome and
its attempt), so the gap between it and the project's reservation task is the project's own work.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
import redis
from psycopg import sql
from psycopg.rows import namedtuple_row

from bench import celery_defaults
from bench.leases import COMPARE_AND_DELETE, UnexpectedReply
from bench.reserve import NOW_MS, RESERVATION_CTES, conninfo
from reservations.finish_statement import STATEMENTS as FINISH_STATEMENTS
from reservations.operations import fingerprint, new_reservation_id
from reservations.reserve_statement import STATEMENTS as FENCED_STATEMENTS
from reservations.sql_text import Sent
from reservations.statuses import ReservationStatus

DATABASE_ENV = "BENCH_RAW_DATABASE_URL"  # a libpq conninfo or postgresql:// URL
LOCK_ENV = "BENCH_RAW_LOCK_URL"
RAW_RESERVE = "bench.raw_reserve"
RAW_FENCED = "bench.raw_fenced_reserve"
RAW_FENCED_CONFIRM = "bench.raw_fenced_confirm"
LOCK_TTL_MS = 30_000
BUSY_COUNTDOWN = 0.005

app = celery_defaults.app

# bench.reserve's four rows (stock, reservation, history, idempotency record) with the request's outcome
# and attempt added (o, a), as the reservation task's statement writes them.
STATEMENT = (
    sql.SQL(
        "{ctes}, "
        "o AS (INSERT INTO request_outcomes (key, operation, status, detail, task_id, worker, epochs, at_ms, "
        "fingerprint) SELECT %(key)s, 'reserve', 'reserved', json_build_object("
        "'reservation_ids', json_build_array(%(id)s::text), 'token', %(token)s::bigint, "
        "'quantity', %(quantity)s::bigint, 'stock', json_build_array(json_build_object('sku', s.sku, "
        "'on_hand', s.on_hand, 'reserved', s.reserved, 'available', s.available)))::text, "
        "%(task_id)s, %(worker)s, 0, {now}, %(fingerprint)s FROM s), "
        "a AS (INSERT INTO task_attempts (key, operation, result, task_id, worker, token, detail, at_ms) "
        "SELECT %(key)s, 'reserve', 'applied', %(task_id)s, %(worker)s, %(token)s, NULL, {now} FROM s) "
        "SELECT sku, on_hand, reserved, available FROM s"
    )
    .format(ctes=RESERVATION_CTES, now=NOW_MS)
    .as_bytes()
)


# The request's record a producer writes before it publishes, as the project's client writes it (the same
# table and columns, the relay's next look included), in one plain INSERT: no key conflict handled.
RECORD = (
    sql.SQL(
        "INSERT INTO accepted_requests (key, operation, fingerprint, at_ms, request_type, arguments, "
        "task_id, message_format, publishes, next_look_ms) VALUES (%(key)s, %(operation)s, %(fingerprint)s, "
        "{now}, %(operation)s, %(arguments)s, %(task_id)s, 2, 1, {now} + 30000)"
    )
    .format(now=NOW_MS)
    .as_bytes()
)


# The fenced reference's lock: SET NX PX and, when it is taken, the SKU's next token, in one round trip.
LOCK_WITH_TOKEN = (
    "if redis.call('set',KEYS[1],ARGV[1],'NX','PX',ARGV[2]) then return redis.call('incr',KEYS[2]) "
    "else return 0 end"
)
# The project's reservation statement with its fence and its request's outcome and attempt, as the
# reservation task sends it (reservations.reserve_statement), rows held as long as the task's hold.
FENCED = FENCED_STATEMENTS[(True, True)]
# And the project's confirm statement (reservations.finish_statement), as a confirm's task sends it.
FENCED_CONFIRM = FINISH_STATEMENTS[ReservationStatus.CONFIRMED][(True, True)]
FENCED_HOLD_MS = 15 * 60 * 1000


class Recorder:
    """The producer's side of the reference with a record: each request's row written in autocommit on a
    connection of its own before the request is published, as "nothing accepted vanishes" needs."""

    def __init__(self, database_url: str) -> None:
        self.database = psycopg.connect(conninfo(database_url), autocommit=True)

    def __call__(self, kwargs: dict[str, Any], task_id: str, operation: str) -> None:
        if operation == "reserve":
            print_ = fingerprint("reserve", sku=kwargs["sku"], quantity=kwargs["quantity"], hold_ms=None)
        else:
            print_ = fingerprint(operation, reservation_id=kwargs["reservation_id"])
        arguments = json.dumps(kwargs, separators=(",", ":"))
        key = kwargs["idempotency_key"]
        params = {
            "key": key, "operation": operation, "fingerprint": print_, "arguments": arguments,
            "task_id": task_id,
        }  # fmt: skip
        self.database.execute(RECORD, params)

    def close(self) -> None:
        self.database.close()


def environment(redis_base: str, first_db: int, database_url: str) -> dict[str, str]:
    """A worker's environment for this app: its broker, results and lock in three databases of the
    redis-server at ``redis_base`` from ``first_db`` on, the rows in the database at ``database_url``."""
    return {
        celery_defaults.BROKER_ENV: f"{redis_base}/{first_db}",
        celery_defaults.BACKEND_ENV: f"{redis_base}/{first_db + 1}",
        DATABASE_ENV: conninfo(database_url),
        LOCK_ENV: f"{redis_base}/{first_db + 2}",
    }


@dataclass
class _Clients:
    pid: int
    lock: redis.Redis
    release: Any
    database: psycopg.Connection[Any]
    take: Any


_clients: _Clients | None = None


def clients() -> _Clients:
    """This process's connections, made on first use (again in a forked pool child)."""
    global _clients
    if _clients is None or _clients.pid != os.getpid():
        lock = redis.Redis.from_url(os.environ[LOCK_ENV])
        database = psycopg.connect(os.environ[DATABASE_ENV], autocommit=True)
        release, take = lock.register_script(COMPARE_AND_DELETE), lock.register_script(LOCK_WITH_TOKEN)
        _clients = _Clients(os.getpid(), lock, release, database, take)
    return _clients


class LockTaken(Exception):
    pass


@app.task(name=RAW_RESERVE, bind=True, max_retries=None)  # type: ignore[untyped-decorator]
def raw_reserve(self: Any, sku: str, quantity: int, idempotency_key: str) -> dict[str, Any]:
    c = clients()
    name, holder = f"raw-lock:{sku}", uuid.uuid4().hex
    if not c.lock.set(name, holder, nx=True, px=LOCK_TTL_MS):
        raise self.retry(countdown=BUSY_COUNTDOWN, exc=LockTaken(sku))
    reservation = new_reservation_id()
    try:
        with c.database.cursor() as cur:
            cur.execute(STATEMENT, {
                "sku": sku, "quantity": quantity, "key": idempotency_key, "id": reservation,
                "token": 0, "lease_id": holder, "holder": holder, "task_id": self.request.id,
                "worker": self.request.hostname,
                "fingerprint": fingerprint("reserve", sku=sku, quantity=quantity, hold_ms=None),
            })  # fmt: skip
            row = cur.fetchone()
    finally:
        c.release(keys=[name], args=[holder])
    if row is None:
        return {"status": "insufficient_stock", "key": idempotency_key, "operation": "reserve"}
    _, on_hand, reserved, available = row
    return {
        "status": "reserved", "epochs": 0, "key": idempotency_key, "operation": "reserve",
        "detail": {"reservation_ids": [reservation], "token": 0, "quantity": quantity,
                   "stock": [{"sku": sku, "on_hand": on_hand, "reserved": reserved, "available": available}]},
    }  # fmt: skip


def _fenced(
    task: Any, sku: str, statement: Sent, values: Callable[[int, str], dict[str, Any]], what: str
) -> tuple[int, Any]:
    """The fenced reference's write: the SKU's lock with its next token (one script), ``statement`` sent
    with ``values(token, holder)`` on the plain autocommit connection, the lock's release; the statement's
    row, which must say it wrote (``what`` names the write)."""
    c = clients()
    name, holder = f"raw-lock:{sku}", uuid.uuid4().hex
    token = int(c.take(keys=[name, f"raw-token:{sku}"], args=[holder, LOCK_TTL_MS]))
    if not token:
        raise task.retry(countdown=BUSY_COUNTDOWN, exc=LockTaken(sku))
    try:
        with c.database.cursor(row_factory=namedtuple_row) as cur:
            cur.execute(statement.text, statement.bind(values(token, holder)))
            row: Any = cur.fetchone()
    finally:
        c.release(keys=[name], args=[holder])
    if row is None or not row.applied:
        raise UnexpectedReply(f"the fenced reference's {what} was not applied: {row}")
    return token, row


@app.task(name=RAW_FENCED, bind=True, max_retries=None)  # type: ignore[untyped-decorator]
def raw_fenced_reserve(self: Any, sku: str, quantity: int, idempotency_key: str) -> dict[str, Any]:
    """The reference that keeps every guarantee of the reservation task's writes and none of its layers:
    a lock that hands out a token (one script), the project's one statement with its fence, idempotency
    lookup, stock row lock, outcome and attempt, sent on a plain autocommit connection, and the lock's
    release. No message checks, late acks, lease renewal, epoch log or hot-SKU protocol."""
    reservation = new_reservation_id()

    def values(token: int, holder: str) -> dict[str, Any]:
        return {
            "key": idempotency_key, "sku": sku, "quantity": quantity, "token": token, "lease_id": holder,
            "holder": holder, "hold_ms": FENCED_HOLD_MS, "reservation_id": reservation, "record": True,
            "fingerprint": fingerprint("reserve", sku=sku, quantity=quantity, hold_ms=None),
            "task_id": self.request.id, "worker": self.request.hostname, "epochs": 0,
        }  # fmt: skip

    token, row = _fenced(self, sku, FENCED, values, f"reservation of {sku}")
    return {
        "status": "reserved", "epochs": 0, "key": idempotency_key, "operation": "reserve",
        "detail": {"reservation_ids": [reservation], "token": token, "quantity": quantity,
                   "stock": [{"sku": sku, "on_hand": row.on_hand, "reserved": row.reserved,
                              "available": row.available}]},
    }  # fmt: skip


@app.task(name=RAW_FENCED_CONFIRM, bind=True, max_retries=None)  # type: ignore[untyped-decorator]
def raw_fenced_confirm(self: Any, sku: str, reservation_id: str, idempotency_key: str) -> dict[str, Any]:
    """The fenced reference's confirm: the SKU's lock with its next token, the project's confirm statement
    (the reservation's SKU checked against the lock's, the fence, the idempotency lookup, the outcome and
    attempt) on the plain connection, the lock's release."""

    def values(token: int, holder: str) -> dict[str, Any]:
        return {
            "key": idempotency_key, "operation": "confirm", "status": ReservationStatus.CONFIRMED.value,
            "fingerprint": fingerprint("confirm", reservation_id=reservation_id), "token": token,
            "lease_id": holder, "holder": holder, "reservation_id": reservation_id,
            "reservation_ids": json.dumps([reservation_id]), "detail": "{}", "history_detail": None,
            "record": True, "task_id": self.request.id, "worker": self.request.hostname, "epochs": 0,
            "final": ReservationStatus.CONFIRMED.value, "lease_sku": sku,
        }  # fmt: skip

    token, row = _fenced(self, sku, FENCED_CONFIRM, values, f"confirm of {reservation_id}")
    return {
        "status": "confirmed", "epochs": 0, "key": idempotency_key, "operation": "confirm",
        "detail": {"reservation_ids": [reservation_id], "token": token, "quantity": row.quantity,
                   "stock": [{"sku": sku, "on_hand": row.on_hand, "reserved": row.reserved,
                              "available": row.available}]},
    }  # fmt: skip
