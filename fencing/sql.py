"""SQL plumbing shared by the SQL lease backend and the fence guard: engines, the database clock, and
the sync and async shells that run plans inside one transaction.

Supported dialects: SQLite (3.35+, for RETURNING) and PostgreSQL through psycopg 3, directly or through a
pooler: ``pooling="transaction"`` (PgBouncer's transaction pooling) shares server sessions between
clients, so nothing may live in a session there: no prepared statements, no per-connection settings.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import FunctionElement

from fencing.errors import BackendUnavailable, InvalidLeaseRequest, SchemaMissing
from fencing.plan import (
    Alone,
    Atomic,
    Bound,
    Command,
    Op,
    Plan,
    ScriptCall,
    Sleep,
    Statement,
    T,
    foreign,
    run_async,
    run_sync,
)

SUPPORTED_DIALECTS = ("sqlite", "postgresql")

# How the server sessions behind a PostgreSQL URL are held: "session", one per client connection for as
# long as it lives (directly, or a pooler in session mode); "transaction", lent per transaction (PgBouncer
# pool_mode=transaction), so the next transaction of the same client may run in another client's session.
Pooling = Literal["session", "transaction"]
POOLING_MODES: tuple[str, ...] = get_args(Pooling)


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


def normalize_url(url: str | URL, *, asynchronous: bool = False) -> URL:
    """Pick the drivers this package ships with: psycopg 3 for PostgreSQL, aiosqlite for async SQLite."""
    try:
        parsed = make_url(url)
    except Exception as exc:  # ArgumentError, ValueError: the caller only needs "not a usable URL"
        raise InvalidLeaseRequest(f"not a database URL: {mask_url(str(url))}") from exc
    backend = parsed.get_backend_name()
    if backend not in SUPPORTED_DIALECTS:
        raise InvalidLeaseRequest(f"unsupported database {backend!r}; use sqlite or postgresql")
    if backend == "postgresql":
        return parsed.set(drivername="postgresql+psycopg")
    return parsed.set(drivername="sqlite+aiosqlite" if asynchronous else "sqlite+pysqlite")


_SECRET_QUERY_KEYS = ("password", "passwd", "pwd", "secret", "token", "sslpassword")


def mask_url(url: str | URL) -> str:
    """The URL as it may be printed: the password, and password-like query parameters, as ``***``. A
    list of URLs (kombu's ``sentinel://a;sentinel://b``) is masked part by part; one naming several
    hosts (``redis+sentinel://:pw@s1:26379,s2:26379/service``), which SQLAlchemy cannot parse, by hand."""
    if isinstance(url, str) and ";" in url and all("://" in part for part in url.split(";") if part):
        return ";".join(mask_url(part) if part else "" for part in url.split(";"))
    try:
        parsed = make_url(_quote_userinfo_at(url) if isinstance(url, str) else url)
    except Exception:
        return _mask_by_hand(url) if isinstance(url, str) and "://" in url else "<unparseable url>"
    query = {
        key: ("***" if any(word in key.lower() for word in _SECRET_QUERY_KEYS) else value)
        for key, value in parsed.query.items()
    }
    return parsed.set(query=query).render_as_string(hide_password=True).replace("%2A%2A%2A", "***")


def _mask_by_hand(url: str) -> str:
    """``url`` with the password of its user information and its password-like query values as ``***``,
    the rest as written."""
    scheme, _, rest = url.partition("://")
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    userinfo, at, hosts = rest[:end].rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.partition(":")[0] + ":***"
    tail = rest[end:]
    path, question, query = tail.partition("?")
    if question:
        pairs = [pair.partition("=") for pair in query.split("&")]
        query = "&".join(
            f"{key}{eq}{'***' if any(word in key.lower() for word in _SECRET_QUERY_KEYS) else value}"
            for key, eq, value in pairs
        )
    return f"{scheme}://{userinfo}{at}{hosts}{path}{question}{query}"


def _quote_userinfo_at(url: str) -> str:
    """``url`` with each ``@`` before the last one of its authority written ``%40``. Redis and the
    broker (urllib, kombu) take the host after the last ``@``, so ``redis://:my@secret@host`` has the
    password ``my@secret``; SQLAlchemy's parser stops at the first and would print ``secret`` as part of
    the host."""
    scheme, sep, rest = url.partition("://")
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    userinfo, at, host = rest[:end].rpartition("@")
    if not sep or not at:
        return url
    return f"{scheme}://{userinfo.replace('@', '%40')}@{host}{rest[end:]}"


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


def _postgres_options(kwargs: dict[str, Any], pooling: Pooling, transaction_timeout: float | None) -> None:
    """``kwargs`` for ``create_engine`` with what ``pooling`` asks of psycopg."""
    if pooling not in POOLING_MODES:
        raise InvalidLeaseRequest(f"unknown pooling {pooling!r}; use one of {', '.join(POOLING_MODES)}")
    if pooling == "transaction":
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
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        kwargs.setdefault("connect_args", {"timeout": 30})
        engine = sa.create_engine(parsed, **kwargs)
        _sqlite_setup(engine)
        return engine
    _postgres_options(kwargs, pooling, transaction_timeout)
    # No pool_pre_ping: it costs a round trip per transaction. A connection that died with the server
    # fails its first statement, which surfaces as BackendUnavailable and invalidates the pool.
    engine = sa.create_engine(parsed, **kwargs)
    if transaction_timeout is not None:
        _bound_transactions(engine, transaction_timeout)
    return engine


def make_async_engine(
    url: str | URL,
    *,
    transaction_timeout: float | None = None,
    pooling: Pooling = "session",
    **kwargs: Any,
) -> AsyncEngine:
    """The asyncio twin of :func:`make_engine`, with the same options."""
    parsed = normalize_url(url, asynchronous=True)
    if parsed.get_backend_name() == "sqlite":
        kwargs.setdefault("connect_args", {"timeout": 30})
        engine = create_async_engine(parsed, **kwargs)
        _sqlite_setup(engine.sync_engine)
        return engine
    _postgres_options(kwargs, pooling, transaction_timeout)
    engine = create_async_engine(parsed, **kwargs)
    if transaction_timeout is not None:
        _bound_transactions(engine.sync_engine, transaction_timeout)
    return engine


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


@dataclass(frozen=True, slots=True)
class Rows:
    """A statement's result, fully read, so plans never hold a live cursor."""

    rows: list[Any]  # sqlalchemy Rows; typed loosely because their width depends on the statement

    def first(self) -> Any:
        return self.rows[0] if self.rows else None


def _rows(result: sa.CursorResult[Any]) -> Rows:
    rows = list(result.all()) if result.returns_rows else []
    return Rows(rows=rows)


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
            return _rows(conn.execute(stmt.statement, stmt.params))
        return _rows(conn.execute(stmt))
    except DBAPIError as exc:
        raise mapped(exc, "statement") from exc


async def execute_async(conn: AsyncConnection, stmt: Statement) -> Rows:
    try:
        if isinstance(stmt, Bound):
            return _rows(await conn.execute(stmt.statement, stmt.params))
        return _rows(await conn.execute(stmt))
    except DBAPIError as exc:
        raise mapped(exc, "statement") from exc


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
        conn: Connection | None = None

        def handle(op: Op) -> Any:
            nonlocal conn
            if isinstance(op, Sleep):
                return self._sleep(op.seconds)
            if isinstance(op, Atomic):
                return self.run(op.plan)
            if isinstance(op, Alone):
                return self._alone(op)
            if isinstance(op, ScriptCall | Command):
                raise foreign("SQL", op)
            if conn is None:
                try:
                    conn = self.engine.connect()
                    conn.begin()
                except DBAPIError as exc:
                    raise mapped(exc, "connect", self.translate) from exc
            try:
                return execute(conn, op)
            except DBAPIError as exc:
                raise mapped(exc, "statement", self.translate) from exc

        try:
            result = run_sync(plan, handle)
            if conn is not None:
                conn.commit()
            return result
        except DBAPIError as exc:
            raise mapped(exc, "commit", self.translate) from exc
        finally:
            if conn is not None:
                conn.close()  # rolls back anything not committed

    def _alone(self, op: Alone) -> Rows:
        if self.engine.dialect.name != "postgresql":
            return self.run(_just(op))
        try:
            with self.engine.connect() as conn:
                auto = conn.execution_options(isolation_level="AUTOCOMMIT")
                if isinstance(op.statement, str):
                    return _rows(auto.exec_driver_sql(op.statement, op.params))
                return _rows(auto.execute(op.statement, op.params))
        except DBAPIError as exc:
            raise mapped(exc, "statement", self.translate) from exc

    def close(self) -> None:
        self.engine.dispose()


class AsyncSqlExecutor:
    """The async shell of :class:`SyncSqlExecutor` over an ``AsyncEngine``."""

    def __init__(
        self,
        engine: AsyncEngine,
        sleep: Callable[[float], Awaitable[Any]],
        *,
        translate: Translate | None = None,
    ) -> None:
        self.engine = engine
        self._sleep = sleep
        # The caller's own typed errors for database errors (reservations.constraints), or None.
        self.translate = translate

    async def run(self, plan: Plan[T]) -> T:
        conn: AsyncConnection | None = None

        async def handle(op: Op) -> Any:
            nonlocal conn
            if isinstance(op, Sleep):
                return await self._sleep(op.seconds)
            if isinstance(op, Atomic):
                return await self.run(op.plan)
            if isinstance(op, Alone):
                return await self._alone(op)
            if isinstance(op, ScriptCall | Command):
                raise foreign("SQL", op)
            if conn is None:
                try:
                    conn = await self.engine.connect()
                    await conn.begin()
                except DBAPIError as exc:
                    raise mapped(exc, "connect", self.translate) from exc
            try:
                return await execute_async(conn, op)
            except DBAPIError as exc:
                raise mapped(exc, "statement", self.translate) from exc

        try:
            result = await run_async(plan, handle)
            if conn is not None:
                await conn.commit()
            return result
        except DBAPIError as exc:
            raise mapped(exc, "commit", self.translate) from exc
        finally:
            if conn is not None:
                await conn.close()

    async def _alone(self, op: Alone) -> Rows:
        if self.engine.dialect.name != "postgresql":
            return await self.run(_just(op))
        try:
            async with self.engine.connect() as conn:
                auto = await conn.execution_options(isolation_level="AUTOCOMMIT")
                if isinstance(op.statement, str):
                    return _rows(await auto.exec_driver_sql(op.statement, op.params))
                return _rows(await auto.execute(op.statement, op.params))
        except DBAPIError as exc:
            raise mapped(exc, "statement", self.translate) from exc

    async def close(self) -> None:
        await self.engine.dispose()
