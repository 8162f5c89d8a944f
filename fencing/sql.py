"""A plan's statements on the database: the database's clock, one statement run with its rows read whole,
database errors mapped to what callers catch, and the sync and async shells that run SQL plans, each plan
(and each :class:`Atomic` step) in one transaction. Engines are made in :mod:`fencing.engines`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, cast

import psycopg
import sqlalchemy as sa
from psycopg.pq import ExecStatus, TransactionStatus
from psycopg.rows import namedtuple_row
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import ClauseElement, Executable, FunctionElement
from sqlalchemy.util import await_only, greenlet_spawn

from fencing.errors import BackendUnavailable, SchemaMissing
from fencing.plan import (
    Alone,
    Atomic,
    Bound,
    Command,
    Gateway,
    Op,
    Plan,
    ScriptCall,
    ScriptCalls,
    Sleep,
    Statement,
    T,
    foreign,
    run_sync,
    taken,
)


class db_now_ms(FunctionElement[int]):
    """The database's wall clock in integer milliseconds since the epoch.

    Lease expiry is judged by this clock, never the client's, so clients with skewed clocks agree. It is
    stable within one statement (PostgreSQL's statement_timestamp, SQLite's 'now'), so two columns set
    from it in one INSERT agree exactly.
    """

    type = sa.BigInteger()
    inherit_cache = True


@compiles(db_now_ms, "postgresql")
def _now_pg(element: db_now_ms, compiler: Any, **kw: Any) -> str:
    return "CAST(EXTRACT(EPOCH FROM statement_timestamp()) * 1000 AS BIGINT)"


@compiles(db_now_ms, "sqlite")
def _now_sqlite(element: db_now_ms, compiler: Any, **kw: Any) -> str:
    return "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)"


class one_snapshot(Executable, ClauseElement):
    """A plan's first statement when its later reads must agree with each other: every statement of the
    transaction then reads the database as of one moment. PostgreSQL's default (READ COMMITTED) gives each
    statement its own snapshot, so a read of the stock and a later read of its history, taken while a
    worker commits between them, disagree on a consistent inventory; REPEATABLE READ READ ONLY takes one
    snapshot for the whole transaction and, reading only, can never fail to serialize. SQLite's
    transactions are serialized already (BEGIN IMMEDIATE, fencing.engines): there it asks nothing."""

    inherit_cache = True


@compiles(one_snapshot, "postgresql")
def _snapshot_pg(element: one_snapshot, compiler: Any, **kw: Any) -> str:
    return "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"


@compiles(one_snapshot, "sqlite")
def _snapshot_sqlite(element: one_snapshot, compiler: Any, **kw: Any) -> str:
    return "SELECT 1"


@dataclass(frozen=True, slots=True)
class Rows:
    """A statement's result, fully read, so plans never hold a live cursor."""

    rows: list[Any]  # sqlalchemy Rows; typed loosely because their width depends on the statement

    def first(self) -> Any:
        return self.rows[0] if self.rows else None

    @staticmethod
    def of(result: sa.CursorResult[Any]) -> Rows:
        return Rows(rows=list(result.all()) if result.returns_rows else [])


# SQLSTATEs that end the session rather than the statement: the server shut down or terminated it, or
# ended a transaction left idle past idle_in_transaction_session_timeout (psycopg raises the last one as
# an InternalError).
_SESSION_ENDED = ("57P01", "57P02", "57P03", "25P03")


def unavailable(exc: DBAPIError, operation: str) -> BackendUnavailable | None:
    """The error to raise for a database that cannot be reached, or None for any other database error."""
    sqlstate = getattr(exc.orig, "sqlstate", None)
    ended = isinstance(sqlstate, str) and (sqlstate.startswith("08") or sqlstate in _SESSION_ENDED)
    if isinstance(exc, OperationalError | InterfaceError) or exc.connection_invalidated or ended:
        detail = str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__
        return BackendUnavailable(backend="database", operation=operation, detail=detail)
    return None


# A table or column the migrations create, as PostgreSQL (SQLSTATE) and SQLite (message) report it.
_SCHEMA_STATES = {"42P01": "missing", "42703": "out of date"}
_SCHEMA_MESSAGES = {
    "no such table": "missing",
    "no such column": "out of date",
    "has no column": "out of date",
}


def schema_missing(exc: DBAPIError, operation: str) -> SchemaMissing | None:
    """The error to raise for a table or column the migrations create being absent, else None."""
    if exc.orig is None:
        return None
    first = str(exc.orig).strip().splitlines()[0]
    state = getattr(exc.orig, "sqlstate", None)
    if state is not None:
        problem = _SCHEMA_STATES.get(state)
    else:
        problem = next((v for k, v in _SCHEMA_MESSAGES.items() if k in first), None)
    return None if problem is None else SchemaMissing(operation=operation, problem=problem, detail=first)


# Maps a database error to the caller's own typed error (for example by constraint name), or None.
Translate = Callable[[DBAPIError], Exception | None]


def mapped(exc: DBAPIError, operation: str, translate: Translate | None = None) -> Exception:
    """The one place a database error becomes what callers catch: the caller's translation first, then a
    missing schema, then an unreachable database; anything else stays the driver's error."""
    found = translate(exc) if translate is not None else None
    return found or schema_missing(exc, operation) or unavailable(exc, operation) or exc


def execute(conn: Connection, stmt: Statement) -> Rows:
    """Run one statement of a plan on a sync connection."""
    try:
        if isinstance(stmt, Bound):
            if isinstance(stmt.statement, str):
                return Rows.of(conn.exec_driver_sql(stmt.statement, stmt.params))
            return Rows.of(conn.execute(stmt.statement, stmt.params))
        return Rows.of(conn.execute(stmt))
    except DBAPIError as exc:
        raise mapped(exc, "statement") from exc


def watched(engine: Engine) -> bool:
    """Whether anything listens to ``engine``'s statements or their errors (statement counters, tracers,
    error hooks): those see only what SQLAlchemy itself executes."""
    events = engine.dispatch
    return bool(
        events.before_cursor_execute or events.after_cursor_execute or engine.dialect.dispatch.handle_error
    )


def execute_alone(engine: Engine, sql: str, params: dict[str, Any] | None) -> Rows:
    """Driver-level ``sql`` (PostgreSQL, psycopg) on a pooled connection in autocommit, read whole.

    The statement goes straight to the driver's cursor: SQLAlchemy's execution context, result metadata
    and Row objects cost more client time per call than psycopg's own sending and reading (a reservation
    is one such statement). The rows are named tuples with the statement's column names, read by
    attribute as SQLAlchemy's rows are. A driver error comes out as SQLAlchemy's DBAPIError, as from
    SQLAlchemy's own execution, and a lost connection is invalidated with its pool's generation. On an
    async engine (``sync_engine`` of one, run in SQLAlchemy's greenlet bridge as every async plan is) the
    connection is psycopg's AsyncConnection, and each of the same steps is awaited through the bridge."""
    step: Callable[[Any], Any] = await_only if engine.dialect.is_async else taken
    try:
        pooled = engine.raw_connection()
    except psycopg.Error as exc:
        # The pool hands out the driver's own error where connect() would wrap it: a server that refuses
        # connections (down, or not yet promoted) must reach the caller as unavailable, like a lost one.
        raise DBAPIError.instance(sql, params, exc, psycopg.Error, dialect=engine.dialect) from exc
    # psycopg's Connection, or its AsyncConnection on an async engine.
    driver: Any = pooled.driver_connection
    cursor = None
    try:
        step(driver.set_autocommit(True))
        cursor = driver.cursor(row_factory=namedtuple_row)
        step(cursor.execute(sql, params))
        # Whether it returned rows from the result's status: cursor.description builds a column per column.
        returned = cursor.pgresult is not None and cursor.pgresult.status == ExecStatus.TUPLES_OK
        return Rows(step(cursor.fetchall()) if returned else [])
    except psycopg.Error as exc:
        lost = engine.dialect.is_disconnect(cast(Any, exc), pooled, cast(Any, cursor))
        if lost:
            # As SQLAlchemy does for its own statements: the pool's older connections are suspect too.
            engine.pool._invalidate(pooled, exc)
        raise DBAPIError.instance(
            sql,
            params,
            exc,
            psycopg.Error,
            connection_invalidated=lost,
            dialect=engine.dialect,
        ) from exc
    finally:
        if cursor is not None:
            step(cursor.close())
        if pooled.is_valid:
            if driver.info.transaction_status == TransactionStatus.IDLE:
                step(driver.set_autocommit(False))  # as the pool lends it: statements open a transaction
            else:  # interrupted mid-statement: no state to hand the next borrower
                pooled.invalidate()
        pooled.close()


def driver_text(op: Alone, engine: Engine) -> str | None:
    """The text the driver takes for ``op``'s statement: its own when it is driver-level SQL, else its
    compiled text when SQLAlchemy would add nothing to what goes to the driver or comes back
    (:func:`_plain`); None otherwise. Only a statement sent with bound values is compiled here: those are
    built once (a statement of literal values is built per call, and SQLAlchemy compiles it anyway)."""
    if isinstance(op.statement, str):
        return op.statement
    if op.params is None:
        return None
    return _plain(cast(ClauseElement, op.statement), engine.dialect)


@lru_cache(maxsize=256)
def _plain(statement: ClauseElement, dialect: sa.Dialect) -> str | None:
    """``statement`` compiled once for ``dialect``, when every value it sends is one of its bound names,
    sent as given (no bind processing, no expanding list, no value of its own), and every column it
    returns is read as the driver reads it (no result processing): then the driver's cursor runs it as
    SQLAlchemy would. None otherwise."""
    compiled = cast(Any, statement.compile(dialect=dialect))
    if compiled.positional or compiled._bind_processors:
        return None
    if compiled.post_compile_params or compiled.literal_execute_params:
        return None
    if any(bind.value is not None or bind.callable is not None for bind in compiled.binds.values()):
        return None
    if any(_converted(col.type, dialect) for col in compiled._result_columns):
        return None
    return str(compiled.string)


def _converted(type_: Any, dialect: sa.Dialect) -> bool:
    """Whether SQLAlchemy converts what the driver returns for a column of ``type_``; a type that cannot
    say so before it sees the column's type code (PostgreSQL's NUMERIC) counts as converted."""
    try:
        return type_._cached_result_processor(dialect, None) is not None
    except Exception:
        return True


def _just(op: Alone) -> Plan[Rows]:
    """``op`` as a plan of one statement, for a database that has no autocommit round trip to save."""
    if isinstance(op.statement, str):
        raise TypeError("driver-level SQL runs on PostgreSQL only")
    rows: Rows = yield (op.statement if op.params is None else Bound(op.statement, op.params))
    return rows


class SyncSqlExecutor:
    """Runs each plan (and each :class:`Atomic` step) in its own transaction, opened at its first
    statement so a plan that only waits never holds a connection."""

    def __init__(
        self, engine: Engine, sleep: Callable[[float], None], *, translate: Translate | None = None
    ) -> None:
        self.engine = engine
        self._sleep = sleep
        # The caller's own typed errors for database errors (reservations.constraints), or None.
        self.translate = translate

    def run(self, plan: Plan[T]) -> T:
        with self.unit() as handle:
            return run_sync(plan, handle)

    @contextmanager
    def unit(self) -> Iterator[Callable[[Op], Any]]:
        """One transaction: what a plan's operations are performed with, committed when it ends well."""
        conn: Connection | None = None

        def handle(op: Op) -> Any:
            nonlocal conn
            if isinstance(op, Sleep):
                return self._sleep(op.seconds)
            if isinstance(op, Atomic):
                return self.run(op.plan)
            if isinstance(op, ScriptCall | ScriptCalls | Command | Gateway):
                raise foreign("SQL", op)
            if isinstance(op, Alone) and self.engine.dialect.name != "postgresql":
                return self.run(_just(op))
            try:
                if isinstance(op, Alone):
                    # In autocommit, outside the plan's transaction (sent from here, not from a helper,
                    # so that a one-statement write is the fewest calls from its task).
                    text = None if watched(self.engine) else driver_text(op, self.engine)
                    if text is not None:
                        # On the driver's cursor: the one-statement writes pay no SQLAlchemy execution
                        # around them. An engine whose statements are watched runs them below instead.
                        return execute_alone(self.engine, text, op.params)
                    with self.engine.connect() as alone:
                        auto = alone.execution_options(isolation_level="AUTOCOMMIT")
                        if isinstance(op.statement, str):
                            return Rows.of(auto.exec_driver_sql(op.statement, op.params))
                        return Rows.of(auto.execute(op.statement, op.params))
                if conn is None:
                    try:
                        conn = self.engine.connect()
                        conn.begin()
                    except DBAPIError as exc:
                        raise mapped(exc, "connect", self.translate) from exc
                return execute(conn, op)
            except DBAPIError as exc:
                raise mapped(exc, "statement", self.translate) from exc

        try:
            yield handle
            if conn is not None:
                conn.commit()
        except DBAPIError as exc:
            raise mapped(exc, "commit", self.translate) from exc
        finally:
            if conn is not None:
                conn.close()  # rolls back anything not committed

    def close(self) -> None:
        self.engine.dispose()


class AsyncSqlExecutor:
    """The async shell of :class:`SyncSqlExecutor` over an ``AsyncEngine``: the same units, run on its
    ``sync_engine`` through SQLAlchemy's greenlet bridge (as ``AsyncConnection`` runs each statement),
    each operation awaited."""

    def __init__(
        self,
        engine: AsyncEngine,
        sleep: Callable[[float], Awaitable[Any]],
        *,
        translate: Translate | None = None,
    ) -> None:
        self.engine = engine
        self.translate = translate
        self._blocking = SyncSqlExecutor(
            engine.sync_engine,
            lambda seconds: await_only(sleep(seconds)),
            translate=lambda exc: self.translate(exc) if self.translate is not None else None,
        )

    async def run(self, plan: Plan[T]) -> T:
        return await greenlet_spawn(self._blocking.run, plan)

    async def close(self) -> None:
        await self.engine.dispose()
