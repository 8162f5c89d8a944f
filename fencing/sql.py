"""A plan's statements on the database: the database's clock, and one statement run with its rows read
whole and its errors mapped (:mod:`fencing.sql_errors`). Engines are made in :mod:`fencing.engines`, whole
plans run in :mod:`fencing.sql_executor`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import psycopg
import sqlalchemy as sa
from psycopg.pq import ExecStatus, TransactionStatus
from psycopg.rows import namedtuple_row
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
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
    SQLAlchemy's own execution, and a lost connection is invalidated with its pool's generation."""
    pooled = engine.raw_connection()
    driver = cast(psycopg.Connection[Any], pooled.driver_connection)  # the psycopg dialect's
    cursor = None
    try:
        driver.autocommit = True
        cursor = driver.cursor(row_factory=namedtuple_row)
        cursor.execute(sql, params)
        # Whether it returned rows from the result's status: cursor.description builds a column per column.
        returned = cursor.pgresult is not None and cursor.pgresult.status == ExecStatus.TUPLES_OK
        return Rows(cursor.fetchall() if returned else [])
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
            cursor.close()
        if pooled.is_valid:
            if driver.info.transaction_status == TransactionStatus.IDLE:
                driver.autocommit = False  # as the pool lends it: statements open a transaction
            else:  # interrupted mid-statement: no state to hand the next borrower
                pooled.invalidate()
        pooled.close()
