"""What the inventory tests share: a lease for a SKU, the stock levels of one, the rows an operation could
change (to prove a refused one changed nothing), and the outcomes under a list of keys.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from fencing import Lease, LeaseManager
from fencing.engines import make_engine
from reservations import (
    Inventory,
    scope_of,
)
from reservations.models import reservations, sku_history, stock


def lease_for(leases: LeaseManager, sku: str, holder: str = "w1") -> Lease:
    return leases.acquire(scope_of(sku), ttl=30, holder=holder)


def snapshot(inventory_url: str) -> dict[str, Any]:
    """Everything an operation could change, to prove a refused one changed nothing."""
    engine = make_engine(inventory_url)
    with engine.connect() as conn:
        state = {
            "stock": conn.execute(sa.select(stock).order_by(stock.c.sku)).all(),
            "reservations": conn.execute(sa.select(reservations).order_by(reservations.c.id)).all(),
            "writes": conn.execute(
                sa.select(sku_history).where(sku_history.c.kind == "write").order_by(sku_history.c.id)
            ).all(),
            "keys": conn.execute(sa.text("SELECT key, outcome FROM idempotency_keys ORDER BY key")).all(),
        }
    engine.dispose()
    return state


def level(inventory: Inventory, sku: str) -> tuple[int, int, int]:
    s = inventory.stock(sku)
    return s.on_hand, s.reserved, s.available


def statuses(inventory: Inventory, keys: list[str]) -> dict[str, str | None]:
    found = {key: inventory.request_outcome(key) for key in keys}
    return {key: None if r is None else r.status for key, r in found.items()}


TABLES = (
    "stock",
    "reservations",
    "sku_history",
    "idempotency_keys",
    "request_outcomes",
    "task_attempts",
    "pending_reservations",
    "fencing_leases",
    "fencing_lease_events",
)


def table_rows(url: str, tables: tuple[str, ...]) -> dict[str, list[Any]]:
    engine = make_engine(url)
    with engine.connect() as conn:
        rows = {t: list(conn.execute(sa.text(f"SELECT * FROM {t} ORDER BY 1")).all()) for t in tables}  # noqa: S608
    engine.dispose()
    return rows
