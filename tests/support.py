"""A small protected resource for fencing tests: rows with fence columns and a log of accepted writes;
and the start gate of the contending worker processes the multi-process tests run.

``Resource.write`` is the pattern every user of :class:`fencing.Fence` follows: the guarded UPDATE and
the record of what it did commit in one transaction, so the log shows exactly the accepted writes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import sqlalchemy as sa

from fencing import Fence, FenceResult, Lease, fence_columns
from fencing.sql import make_engine

metadata = sa.MetaData()

items = sa.Table(
    "fenced_items",
    metadata,
    sa.Column("scope", sa.String(200), primary_key=True),
    sa.Column("quantity", sa.Integer, nullable=False),
    *fence_columns(),
)

accepted_writes = sa.Table(
    "fenced_accepted_writes",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("scope", sa.String(200), nullable=False),
    sa.Column("token", sa.BigInteger, nullable=False),
    sa.Column("lease_id", sa.String(32), nullable=False),
    sa.Column("delta", sa.Integer, nullable=False),
)


@dataclass
class Resource:
    url: str
    enforce: bool = True
    engine: sa.Engine = field(init=False)
    fence: Fence = field(init=False)

    def __post_init__(self) -> None:
        self.engine = make_engine(self.url)
        self.fence = Fence(items, enforce=self.enforce)

    def create(self, *scopes: str, quantity: int = 100) -> Resource:
        metadata.create_all(self.engine, checkfirst=True)
        with self.engine.begin() as conn:
            for scope in scopes:
                conn.execute(sa.insert(items).values(scope=scope, quantity=quantity))
        return self

    def write(self, lease: Lease, scope: str, delta: int) -> FenceResult:
        """Add ``delta`` to the row if the result stays non-negative, fenced by ``lease``."""
        with self.engine.begin() as conn:
            result = self.fence.update(
                conn,
                lease,
                scope=scope,
                where=[items.c.scope == scope],
                values={"quantity": items.c.quantity + delta},
                condition=items.c.quantity + delta >= 0,
                returning=[items.c.quantity],
                operation=f"add {delta}",
            )
            if result.applied:
                conn.execute(
                    sa.insert(accepted_writes).values(
                        scope=scope, token=lease.token, lease_id=lease.lease_id, delta=delta
                    )
                )
            return result

    def row(self, scope: str) -> tuple[int, int, str | None]:
        with self.engine.connect() as conn:
            found = conn.execute(
                sa.select(items.c.quantity, items.c.fence_token, items.c.fence_lease_id).where(
                    items.c.scope == scope
                )
            ).one()
            return int(found[0]), int(found[1]), found[2]

    def log(self, scope: str) -> list[tuple[int, str, int]]:
        """Accepted writes in commit order: (token, lease_id, delta)."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(accepted_writes.c.token, accepted_writes.c.lease_id, accepted_writes.c.delta)
                .where(accepted_writes.c.scope == scope)
                .order_by(accepted_writes.c.id)
            ).all()
            return [(int(r[0]), r[1], int(r[2])) for r in rows]

    def close(self) -> None:
        self.engine.dispose()


def start_gate() -> bool:
    """A worker process's side of the start gate: print ``ready`` on stdout, then block until the parent
    writes ``go`` on stdin, so that every worker starts contending at once. False when the parent sent
    anything else or closed stdin: it gave up, and the worker should exit."""
    print("ready", flush=True)
    return sys.stdin.readline().strip() == "go"
