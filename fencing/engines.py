"""Engines for the two supported databases, and the bounds PostgreSQL puts on their transactions.

Supported dialects: SQLite (3.35+, for RETURNING) and PostgreSQL through psycopg 3, directly or through a
pooler: ``pooling="transaction"`` (PgBouncer's transaction pooling) shares server sessions between
clients, so nothing may live in a session there: no prepared statements, no per-connection settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from fencing.errors import InvalidLeaseRequest
from fencing.urls import normalize_url

# How the server sessions behind a PostgreSQL URL are held: "session", one per client connection for as
# long as it lives (directly, or a pooler in session mode); "transaction", lent per transaction (PgBouncer
# pool_mode=transaction), so the next transaction of the same client may run in another client's session.
Pooling = Literal["session", "transaction"]
POOLING_MODES: tuple[str, ...] = get_args(Pooling)


def _sqlite_setup(engine: Engine) -> None:
    # pysqlite's own transaction handling defers BEGIN and breaks SAVEPOINTs; take control of it and
    # start every transaction IMMEDIATE so two writers queue on the busy timeout instead of failing
    # on a read-to-write lock upgrade.
    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def _bound_transactions(engine: Engine, seconds: float) -> None:
    # A holder frozen or cut off inside its transaction keeps the rows it locked until the database ends
    # that transaction: the server does so after ``seconds`` idle, and a writer waiting on a row lock
    # gives up after as long (both surface as errors: the first as lost ownership, the second as a
    # transient failure). Set once per new connection, so pooled transactions pay nothing for it.
    millis = max(1, round(seconds * 1000))

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute(
            "SELECT set_config('idle_in_transaction_session_timeout', %s, false),"
            " set_config('lock_timeout', %s, false)",
            (f"{millis}ms", f"{millis}ms"),
        )
        cursor.close()
        dbapi_connection.commit()  # a rolled-back transaction would take the settings with it


def _engine(
    url: str | URL, asynchronous: bool, pooling: Pooling, transaction_timeout: float | None, **kwargs: Any
) -> Any:
    """The one core of both makers: the drivers and session rules of ``url``'s database, set up on the
    blocking engine (an async engine's ``sync_engine``)."""
    parsed = normalize_url(url, asynchronous=asynchronous)
    sqlite = parsed.get_backend_name() == "sqlite"
    if sqlite:
        kwargs.setdefault("connect_args", {"timeout": 30})
    elif pooling not in POOLING_MODES:
        raise InvalidLeaseRequest(f"unknown pooling {pooling!r}; use one of {', '.join(POOLING_MODES)}")
    elif pooling == "transaction":
        if transaction_timeout is not None:
            # A per-connection SET would land in whichever server session served it and be lost for the
            # client's later transactions: refuse rather than leave a frozen holder's locks unbounded.
            raise InvalidLeaseRequest(
                "a transaction timeout cannot be set per connection behind a transaction pooler; set "
                "idle_in_transaction_session_timeout and lock_timeout on the database or role"
            )
        # psycopg prepares a statement on its 5th execution, in the server session it runs in; the next
        # transaction may run in another session (unknown there), or another client's psycopg may name
        # its own statement the same in this one. Never prepare: every statement is parsed where it runs.
        kwargs["connect_args"] = {**kwargs.get("connect_args", {}), "prepare_threshold": None}
    # No pool_pre_ping: it costs a round trip per transaction. A connection that died with the server
    # fails its first statement, which surfaces as BackendUnavailable and invalidates the pool.
    engine: Any = (create_async_engine if asynchronous else sa.create_engine)(parsed, **kwargs)
    blocking: Engine = engine.sync_engine if asynchronous else engine
    if sqlite:
        _sqlite_setup(blocking)
    elif transaction_timeout is not None:
        _bound_transactions(blocking, transaction_timeout)
    return engine


def make_engine(
    url: str | URL,
    *,
    transaction_timeout: float | None = None,
    pooling: Pooling = "session",
    **kwargs: Any,
) -> Engine:
    """An engine for ``url``. ``transaction_timeout`` (PostgreSQL) bounds how long a transaction may sit
    idle, and how long a statement may wait for a row lock, in seconds; set it to the lease ttl.
    ``pooling="transaction"`` (PostgreSQL behind a transaction pooler) turns prepared statements off and
    refuses a ``transaction_timeout``, which only the database or role can set there
    (:func:`transaction_bounds` reads what is in force)."""
    return cast(Engine, _engine(url, False, pooling, transaction_timeout, **kwargs))


def make_async_engine(
    url: str | URL,
    *,
    transaction_timeout: float | None = None,
    pooling: Pooling = "session",
    **kwargs: Any,
) -> AsyncEngine:
    """The asyncio twin of :func:`make_engine`, with the same options."""
    return cast(AsyncEngine, _engine(url, True, pooling, transaction_timeout, **kwargs))


@dataclass(frozen=True, slots=True)
class TransactionBounds:
    """How long PostgreSQL lets a transaction of this session sit idle, and a statement wait for a lock,
    in milliseconds as a new transaction sees them (0: no bound)."""

    idle_ms: int
    lock_ms: int

    def beyond(self, seconds: float) -> list[str]:
        """The settings that do not end a wait within ``seconds`` (unbounded or longer), each as
        ``name=value``; empty when both do."""
        limit = seconds * 1000
        found = (("idle_in_transaction_session_timeout", self.idle_ms), ("lock_timeout", self.lock_ms))
        return [f"{name}={ms}ms" if ms else f"{name}=0 (none)" for name, ms in found if not 0 < ms <= limit]


def transaction_bounds(engine: Engine) -> TransactionBounds:
    """The bounds in force for ``engine``'s transactions (PostgreSQL), read in a transaction of its own:
    behind a transaction pooler, the database's and role's settings, which every server session starts
    with (the pooler may lend this client any of them)."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT name, setting FROM pg_settings"
                " WHERE name IN ('idle_in_transaction_session_timeout', 'lock_timeout')"
            )
        ).all()
    found = {name: int(setting) for name, setting in rows}  # both are kept in milliseconds
    return TransactionBounds(found["idle_in_transaction_session_timeout"], found["lock_timeout"])
