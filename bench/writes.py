"""Guarded writes: ``Fence.update`` against the same UPDATE without the token predicate and against a
bare ``sa.update``. One unit of work is one write in its own transaction, as applications use it.
"""

from __future__ import annotations

from contextlib import ExitStack

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bench.leases import UnexpectedReply
from bench.timing import Case, Op, Progress, Results, measure
from fencing import Fence, Lease, LeaseManager, fence_columns
from fencing.engines import make_engine

SKU = "SKU-1"
SCOPE = f"stock:{SKU}"
SEED = 10**9  # enough stock that no write in any run meets an empty shelf

GUARDED = "Fence.update (guarded)"
UNGUARDED = "Fence(enforce=False).update"
RAW = "raw sa.update"

metadata = sa.MetaData()
stock = sa.Table(
    "bench_stock",
    metadata,
    sa.Column("sku", sa.String(64), primary_key=True),
    sa.Column("available", sa.Integer, nullable=False),
    *fence_columns(),
)


# Every variant builds its expressions per call, as application code does; only the statement differs.
def fence_write(engine: Engine, fence: Fence, lease: Lease) -> Op:
    def op() -> None:
        with engine.begin() as conn:
            result = fence.update(
                conn,
                lease,
                scope=SCOPE,
                where=[stock.c.sku == SKU],
                values={"available": stock.c.available - 1},
                condition=stock.c.available > 0,
                operation="reserve",
            )
        if not result.applied:
            raise UnexpectedReply(f"{fence!r} write not applied: {result.outcome}")

    return op


def raw_write(engine: Engine) -> Op:
    def op() -> None:
        with engine.begin() as conn:
            written = conn.execute(
                sa.update(stock)
                .where(stock.c.sku == SKU, stock.c.available > 0)
                .values(available=stock.c.available - 1)
            )
        if written.rowcount != 1:
            raise UnexpectedReply(f"raw update wrote {written.rowcount} rows")

    return op


def guarded_vs_plain(
    url: str,
    label: str,
    results: Results,
    *,
    iterations: int,
    warmup: int,
    repeats: int,
    progress: Progress | None = None,
) -> None:
    """``url`` points at scratch space (private schema or temp file) that the caller removes."""
    section = f"Guarded write vs plain write, {label} (1 UPDATE per transaction)"
    with ExitStack() as stack:
        engine = make_engine(url)
        stack.callback(engine.dispose)
        metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(sa.insert(stock).values(sku=SKU, available=SEED))

        # The lease comes from the same database, so this section needs no other service.
        manager = stack.enter_context(LeaseManager.from_url(url))
        manager.create_schema()
        lease = manager.acquire(SCOPE, ttl=600, holder="bench")
        stack.callback(manager.release, lease)

        stats = measure(
            [
                Case(GUARDED, fence_write(engine, Fence(stock), lease)),
                Case(UNGUARDED, fence_write(engine, Fence(stock, enforce=False), lease)),
                Case(RAW, raw_write(engine)),
            ],
            iterations=iterations, warmup=warmup, repeats=repeats, progress=progress,
        )
        results.add(section, stats, GUARDED, UNGUARDED)
        results.add(section, stats, GUARDED, RAW)
        results.add(section, stats, UNGUARDED, RAW)
