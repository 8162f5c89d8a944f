"""A plan's statements on the database: the database's clock, and one statement run with its rows read
whole and its errors mapped (:mod:`fencing.sql_errors`). Engines are made in :mod:`fencing.engines`, whole
plans run in :mod:`fencing.sql_executor`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import FunctionElement

from fencing.plan import Bound, Statement
from fencing.sql_errors import mapped


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


@dataclass(frozen=True, slots=True)
class Rows:
    """A statement's result, fully read, so plans never hold a live cursor."""

    rows: list[Any]  # sqlalchemy Rows; typed loosely because their width depends on the statement

    def first(self) -> Any:
        return self.rows[0] if self.rows else None

    @staticmethod
    def of(result: sa.CursorResult[Any]) -> Rows:
        return Rows(rows=list(result.all()) if result.returns_rows else [])


def execute(conn: Connection, stmt: Statement) -> Rows:
    """Run one statement of a plan on a sync connection."""
    try:
        if isinstance(stmt, Bound):
            return Rows.of(conn.execute(stmt.statement, stmt.params))
        return Rows.of(conn.execute(stmt))
    except DBAPIError as exc:
        raise mapped(exc, "statement") from exc


async def execute_async(conn: AsyncConnection, stmt: Statement) -> Rows:
    try:
        if isinstance(stmt, Bound):
            return Rows.of(await conn.execute(stmt.statement, stmt.params))
        return Rows.of(await conn.execute(stmt))
    except DBAPIError as exc:
        raise mapped(exc, "statement") from exc
