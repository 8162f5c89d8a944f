"""The seed timeline, replayed on an embedded SQLite database with the SQL lease backend.

Worker A takes the SKU's lease and stalls with a write in flight; its lease expires; worker B takes the
next token and reserves; A's late write reaches the stock row and is refused as a stale token.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa
from rich.console import Console
from rich.table import Table

from fencing import Fence, Lease, LeaseManager, StaleToken, fence_columns
from fencing.engines import make_engine
from fencing.urls import mask_url
from testing.harness import wait_until

SKU = "WIDGET"
SCOPE = f"sku:{SKU}"

_metadata = sa.MetaData()
demo_stock = sa.Table(
    "demo_stock",
    _metadata,
    sa.Column("sku", sa.String(64), primary_key=True),
    sa.Column("available", sa.Integer, nullable=False),
    *fence_columns(),
    sa.CheckConstraint("available >= 0", name="ck_demo_stock_available"),
)


@dataclass
class Timeline:
    console: Console
    started: float = field(default_factory=time.monotonic)
    rows: list[tuple[str, str, str]] = field(default_factory=list)

    def step(self, who: str, what: str) -> None:
        at = f"{time.monotonic() - self.started:6.3f}s"
        self.rows.append((at, who, what))
        self.console.print(f"[dim]{at}[/]  [bold]{who:<6}[/] {what}")


def _reserve(engine: sa.Engine, fence: Fence, lease: Lease, quantity: int) -> int:
    with engine.begin() as conn:
        result = fence.update(
            conn,
            lease,
            scope=SCOPE,
            where=[demo_stock.c.sku == SKU],
            values={"available": demo_stock.c.available - quantity},
            condition=demo_stock.c.available >= quantity,
            returning=[demo_stock.c.available],
            operation=f"reserve {quantity}",
        )
    if not result.applied:
        raise RuntimeError(f"reserve {quantity} not applied: {result.outcome.value}")
    return int(result.row[0])


def _is_demo_database(path: Path) -> bool:
    engine = sa.create_engine(f"sqlite:///{path}")
    try:
        return sa.inspect(engine).has_table("demo_stock")
    except sa.exc.DatabaseError:
        return False
    finally:
        engine.dispose()


def run(database: Path, *, ttl: float = 0.5, console: Console | None = None) -> bool:
    """Replay the timeline; True when A's late write was refused and the stock is right."""
    # Piped output keeps each line whole (a terminal wraps it at its width).
    console = console or Console(soft_wrap=not sys.stdout.isatty())
    database.parent.mkdir(parents=True, exist_ok=True)
    if database.exists() and not _is_demo_database(database):
        raise ValueError(f"{database} exists and is not a fence-demo database; choose another --database")
    database.unlink(missing_ok=True)
    url = f"sqlite:///{database}"
    console.print(f"[bold]Fencing demo[/] on {mask_url(url)} (SQL lease backend, no services)\n")

    engine = make_engine(url)
    _metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(sa.insert(demo_stock).values(sku=SKU, available=10))
    fence = Fence(demo_stock)
    timeline = Timeline(console)

    with LeaseManager.from_url(url) as manager:
        manager.create_schema()
        a = manager.acquire(SCOPE, ttl=ttl, holder="worker-A")
        timeline.step("A", f"acquires {SCOPE} -> token {a.token} (ttl {ttl}s)")
        timeline.step("A", "checks its lease (valid), sends write(reserve 5) ... and stalls")
        wait_until(lambda: manager.current(SCOPE) is None, timeout=ttl + 5, what="A's lease to expire")
        timeline.step("lease", f"A's lease expires at the database (token {a.token})")
        b = manager.acquire(SCOPE, ttl=5, holder="worker-B")
        timeline.step("B", f"acquires {SCOPE} -> token {b.token}")
        left = _reserve(engine, fence, b, 2)
        timeline.step("B", f"reserve 2 with token {b.token} -> accepted, available {left}")
        manager.release(b)
        timeline.step("B", "releases its lease")
        rejected: StaleToken | None = None
        try:
            _reserve(engine, fence, a, 5)
            timeline.step("A", "late write(reserve 5) ACCEPTED: this would be an oversell")
        except StaleToken as exc:
            rejected = exc
            timeline.step(
                "A",
                f"late write arrives with token {exc.presented} -> REJECTED "
                f"(highest accepted {exc.highest}): lost ownership, A stops",
            )
        history = manager.history(SCOPE)

    with engine.connect() as conn:
        available, highest = conn.execute(
            sa.select(demo_stock.c.available, demo_stock.c.fence_token).where(demo_stock.c.sku == SKU)
        ).one()
    engine.dispose()

    table = Table(title=f"Lease history of {SCOPE}", title_justify="left")
    for column in ("event", "token", "holder", "previous epoch"):
        table.add_column(column)
    for event in history:
        previous = f"{event.previous_token} ({event.previous_end})" if event.previous_end else ""
        table.add_row(event.event, str(event.token), event.holder or "", previous)
    console.print()
    console.print(table)

    ok = rejected is not None and available == 8 and highest == b.token
    console.print(f"\nStock of {SKU}: available {available} (10 - B's 2), highest accepted token {highest}.")
    console.print(
        "[bold green]Invariant holds:[/] the stale write changed nothing."
        if ok
        else "[bold red]Invariant broken.[/]"
    )
    return ok
