"""The fence guard: a write on a protected row that the row itself refuses when the token is stale.

The protected table carries two fence columns: the highest token it has accepted and the lease id that
wrote it. A guarded write is ONE conditional UPDATE that accepts ``token > highest`` or ``token == highest``
from the same lease id, so a stale epoch cannot write after a newer one has, and two leases handed the
same number (a coordinator that lost its counter) cannot both write. Only on rejection does a second read
tell a stale token apart from the write's own condition failing; it cannot change the decision.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection

from fencing.errors import ScopeMismatch, StaleToken
from fencing.lease import Lease, check_lease
from fencing.plan import StatementPlan, run_sync
from fencing.sql import Rows, execute

FENCE_TOKEN_COLUMN = "fence_token"
FENCE_LEASE_COLUMN = "fence_lease_id"


def fence_columns(
    token_column: str = FENCE_TOKEN_COLUMN, lease_column: str = FENCE_LEASE_COLUMN
) -> tuple[sa.Column[int], sa.Column[str]]:
    """The two fence columns, for a table definition: ``Table(..., *fence_columns())``."""
    return (
        sa.Column(token_column, sa.BigInteger, nullable=False, server_default="0"),
        sa.Column(lease_column, sa.String(32), nullable=True),
    )


class FenceOutcome(enum.Enum):
    APPLIED = "applied"
    CONDITION_FAILED = "condition_failed"  # the token was current; the caller's condition was false
    NO_ROW = "no_row"  # nothing matched ``where``


@dataclass(frozen=True, slots=True)
class FenceResult:
    outcome: FenceOutcome
    row: Any = None  # the values of ``returning`` when applied

    @property
    def applied(self) -> bool:
        return self.outcome is FenceOutcome.APPLIED


@dataclass(frozen=True)
class Fence:
    """Guarded writes on ``table``. ``enforce=False`` drops the token condition (the fence columns are
    still written): lease-only protection, for measuring what the fence prevents, never for production.
    """

    table: sa.Table
    token_column: str = FENCE_TOKEN_COLUMN
    lease_column: str = FENCE_LEASE_COLUMN
    enforce: bool = True
    # Called after the local checks, just before the statement is sent: the window in which a pause or
    # a delayed packet makes a write stale. A hook for fault injection; None in normal operation.
    before_statement: Callable[[Lease], None] | None = None

    @property
    def _token(self) -> sa.Column[Any]:
        return self.table.c[self.token_column]

    @property
    def _lease(self) -> sa.Column[Any]:
        return self.table.c[self.lease_column]

    def accepts(self, lease: Lease) -> sa.ColumnElement[bool]:
        """The token condition as a SQL expression, for callers building their own statement."""
        return self.admits(lease.token, lease.lease_id)

    def admits(
        self, token: int | sa.ColumnElement[int], lease_id: str | sa.ColumnElement[str]
    ) -> sa.ColumnElement[bool]:
        """The fence predicate, the one place it is written in SQL: a token above the highest accepted,
        or equal to it from the lease that wrote it. ``token`` and ``lease_id`` may be values or SQL
        expressions (bind parameters, for a statement compiled once and sent as text)."""
        return sa.or_(self._token < token, sa.and_(self._token == token, self._lease == lease_id))

    def prepare(self, lease: Lease, scope: str) -> None:
        """The local checks before a guarded statement is sent, then the ``before_statement`` hook: for
        this fence's own UPDATE and for callers that put :meth:`accepts` into a statement of their own."""
        # The token becomes the row's fence: one past MAX_TOKEN would lock out every later epoch.
        check_lease(lease)
        if lease.scope != scope:
            raise ScopeMismatch(lease_scope=lease.scope, target_scope=scope)
        lease.raise_if_lost()  # sticky: no round trip for a lease already known lost
        if self.before_statement is not None:
            self.before_statement(lease)

    def plan(
        self,
        lease: Lease,
        *,
        scope: str,
        where: Sequence[sa.ColumnElement[bool]],
        values: Mapping[str, Any],
        condition: sa.ColumnElement[bool] | None = None,
        returning: Sequence[sa.ColumnElement[Any]] = (),
        operation: str = "write",
    ) -> StatementPlan[FenceResult]:
        """The guarded write as a plan; ``update`` and ``update_async`` are its two shells."""
        self.prepare(lease, scope)
        guards = [*where]
        if self.enforce:
            guards.append(self.accepts(lease))
        if condition is not None:
            guards.append(condition)
        stmt = (
            sa.update(self.table)
            .where(*guards)
            .values({self.token_column: lease.token, self.lease_column: lease.lease_id, **values})
        )
        # RETURNING, not rowcount, tells whether the row was written: SQLite's driver reports no
        # rowcount for UPDATE ... RETURNING until every row is read.
        written: Rows = yield stmt.returning(self._token, *returning)
        if written.rows:
            row = written.rows[0]
            return FenceResult(FenceOutcome.APPLIED, row[1:] if returning else None)
        fence: Rows = yield sa.select(self._token, self._lease).where(*where)
        row = fence.first()
        if row is None:
            return FenceResult(FenceOutcome.NO_ROW)
        self.refuse_if_stale(lease, scope, int(row[0]), row[1], operation)
        return FenceResult(FenceOutcome.CONDITION_FAILED)

    def refuse_if_stale(
        self, lease: Lease, scope: str, highest: int, writer: str | None, operation: str
    ) -> None:
        """Raise :class:`StaleToken` (and mark the lease lost) if a row whose fence reads ``highest`` and
        ``writer`` refuses ``lease``. For a caller that read the fence under the row's lock, which makes
        the judgement as atomic as the guarded UPDATE's own; otherwise only the UPDATE decides."""
        refused = highest > lease.token or (highest == lease.token and writer != lease.lease_id)  # not admits
        if self.enforce and refused:
            lease.mark_lost(f"{operation} rejected: resource accepted token {highest}")
            raise StaleToken(
                scope=scope,
                presented=lease.token,
                highest=highest,
                lease_id=lease.lease_id,
                holder=lease.holder,
            )

    def update(self, conn: Connection, lease: Lease, **kwargs: Any) -> FenceResult:
        """Run the guarded write on ``conn`` inside the caller's transaction.

        Raises :class:`StaleToken` (and marks the lease lost) when a newer epoch already wrote.
        """
        return run_sync(self.plan(lease, **kwargs), lambda stmt: execute(conn, stmt))

    async def update_async(self, conn: AsyncConnection, lease: Lease, **kwargs: Any) -> FenceResult:
        return await conn.run_sync(lambda sync: self.update(sync, lease, **kwargs))
