"""The sync and async shells that run SQL plans, each plan (and each :class:`Atomic` step) in one
transaction."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util import await_only, greenlet_spawn

from fencing.plan import (
    Alone,
    Atomic,
    Bound,
    Command,
    Op,
    Plan,
    ScriptCall,
    ScriptCalls,
    Sleep,
    T,
    foreign,
    run_sync,
)
from fencing.sql import Rows, execute, execute_alone, watched
from fencing.sql_errors import Translate, mapped


def _just(op: Alone) -> Plan[Rows]:
    """``op`` as a plan of one statement, for a database that has no autocommit round trip to save."""
    if isinstance(op.statement, str):
        raise TypeError("driver-level SQL runs on PostgreSQL only")
    rows: Rows = yield (op.statement if op.params is None else Bound(op.statement, op.params))
    return rows


EngineT = TypeVar("EngineT", Engine, AsyncEngine)
SleepT = TypeVar("SleepT")


class _SqlExecutor(Generic[EngineT, SleepT]):
    def __init__(self, engine: EngineT, sleep: SleepT, *, translate: Translate | None = None) -> None:
        self.engine: EngineT = engine
        self._sleep = sleep
        # The caller's own typed errors for database errors (reservations.constraints), or None.
        self.translate = translate


class SyncSqlExecutor(_SqlExecutor[Engine, Callable[[float], None]]):
    """Runs each plan (and each :class:`Atomic` step) in its own transaction, opened at its first
    statement so a plan that only waits never holds a connection."""

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
            if isinstance(op, ScriptCall | ScriptCalls | Command):
                raise foreign("SQL", op)
            if isinstance(op, Alone) and self.engine.dialect.name != "postgresql":
                return self.run(_just(op))
            try:
                if isinstance(op, Alone):
                    # In autocommit, outside the plan's transaction (sent from here, not from a helper,
                    # so that a one-statement write is the fewest calls from its task).
                    if isinstance(op.statement, str) and not (
                        self.engine.dialect.is_async or watched(self.engine)
                    ):
                        # On the driver's cursor: the one-statement writes pay no SQLAlchemy execution
                        # around them. An engine whose statements are watched runs them below instead.
                        return execute_alone(self.engine, op.statement, op.params)
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


class AsyncSqlExecutor(_SqlExecutor[AsyncEngine, Callable[[float], Awaitable[Any]]]):
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
        super().__init__(engine, sleep, translate=translate)
        self._blocking = SyncSqlExecutor(
            engine.sync_engine,
            lambda seconds: await_only(sleep(seconds)),
            translate=lambda exc: self.translate(exc) if self.translate is not None else None,
        )

    async def run(self, plan: Plan[T]) -> T:
        return await greenlet_spawn(self._blocking.run, plan)

    async def close(self) -> None:
        await self.engine.dispose()
