"""The sync and async shells that run SQL plans, each plan (and each :class:`Atomic` step) in one
transaction."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

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
    run_async,
    run_sync,
)
from fencing.sql import Rows, execute, execute_alone, execute_async, watched
from fencing.sql_errors import Translate, mapped


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
            if isinstance(op, ScriptCall | ScriptCalls | Command):
                raise foreign("SQL", op)
            if isinstance(op, Alone) and self.engine.dialect.name != "postgresql":
                return self.run(_just(op))
            try:
                if isinstance(op, Alone):
                    # In autocommit, outside the plan's transaction (sent from here, not from a helper,
                    # so that a one-statement write is the fewest calls from its task).
                    if isinstance(op.statement, str) and not watched(self.engine):
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
        async with self.unit() as handle:
            return await run_async(plan, handle)

    @asynccontextmanager
    async def unit(self) -> AsyncIterator[Callable[[Op], Awaitable[Any]]]:
        conn: AsyncConnection | None = None

        async def handle(op: Op) -> Any:
            nonlocal conn
            if isinstance(op, Sleep):
                return await self._sleep(op.seconds)
            if isinstance(op, Atomic):
                return await self.run(op.plan)
            if isinstance(op, Alone):
                return await self._alone(op)
            if isinstance(op, ScriptCall | ScriptCalls | Command):
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
            yield handle
            if conn is not None:
                await conn.commit()
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
                    return Rows.of(await auto.exec_driver_sql(op.statement, op.params))
                return Rows.of(await auto.execute(op.statement, op.params))
        except DBAPIError as exc:
            raise mapped(exc, "statement", self.translate) from exc

    async def close(self) -> None:
        await self.engine.dispose()
