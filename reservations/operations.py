"""The inventory's unfenced operations as plans: adding a SKU (or many at once) and purging old idempotency
records. The
fenced writes are :mod:`reservations.lifecycle`'s (reservations), :mod:`reservations.on_hand`'s (restocks
and adjustments) and :mod:`reservations.counting`'s (counts and replenishment to par), each in the
envelope of :mod:`reservations.ledger`, alone or as queued requests through :mod:`reservations.keyed_steps`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from fencing.plan import Plan
from fencing.sql import Rows, db_now_ms
from reservations import validation as valid
from reservations.errors import InvalidRequest
from reservations.ledger import HeldLine, fingerprint, hold_ms_of, new_reservation_id
from reservations.models import idempotency_keys, sku_history, stock
from reservations.request_outcomes import DEFAULT_IDEMPOTENCY_RETENTION
from reservations.values import StockLevel

__all__ = ["MAX_SKUS_ADDED", "AddedSkus", "HeldLine", "fingerprint", "hold_ms_of", "new_reservation_id"]

# SKUs created by one add_skus: its two inserts carry 6 and 8 parameters a row, so a batch stays far under
# PostgreSQL's 65,535 bound parameters and SQLite's 32,766, and one transaction holds SQLite's write lock
# for milliseconds, not for a whole file.
MAX_SKUS_ADDED = 1_000


def add_sku(sku: str, *, on_hand: int = 0) -> Plan[StockLevel]:
    """Create a SKU's stock row (unfenced: no owner can exist for a row that does not)."""
    valid.sku(sku)
    valid.on_hand(on_hand)
    found: Rows = yield sa.select(stock.c.sku).where(stock.c.sku == sku)
    if found.first() is not None:
        raise InvalidRequest(f"SKU {sku!r} already exists", field="sku")
    yield sa.insert(stock).values(
        sku=sku, on_hand=on_hand, reserved=0, available=on_hand, fence_token=0, updated_ms=db_now_ms()
    )
    yield sa.insert(sku_history).values(
        sku=sku,
        at_ms=db_now_ms(),
        kind="write",
        operation="create",
        token=0,
        quantity=on_hand,
        on_hand_delta=on_hand,
        reserved_delta=0,
    )
    return StockLevel(sku=sku, on_hand=on_hand, reserved=0, available=on_hand, fence_token=0)


@dataclass(frozen=True, slots=True)
class AddedSkus:
    """What :func:`add_skus` did: the SKUs it created, and those it skipped because they existed."""

    added: list[StockLevel]
    skipped: list[str]


def new_levels(levels: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    """``(sku, on_hand)`` pairs checked as :func:`add_sku` checks one, and no SKU twice: InvalidRequest
    naming the first that is not (its position in ``levels``, from 1, as ``row``)."""
    checked: list[tuple[str, int]] = []
    seen: set[str] = set()
    for row, pair in enumerate(levels, start=1):
        try:
            sku, on_hand = pair
            valid.sku(sku)
            valid.on_hand(on_hand)
        except (TypeError, ValueError, InvalidRequest) as exc:
            raise InvalidRequest(f"row {row}: {exc}", field="levels") from None
        if sku in seen:
            raise InvalidRequest(f"row {row}: SKU {sku!r} given twice", field="levels")
        seen.add(sku)
        checked.append((sku, on_hand))
    return checked


class _Dialect(Protocol):
    """A shell as :func:`add_skus` sees it: the database it speaks to."""

    dialect: str


def _json_levels(dialect: str, levels: list[tuple[str, int]]) -> sa.Subquery:
    """``levels`` as rows (sku, on_hand) read from one JSON parameter: the statement keeps one shape
    whatever the number of SKUs, so SQLAlchemy compiles it once (a VALUES list of 1,000 rows took 0.1 s to
    compile, each time) and the driver sends one parameter."""
    data = json.dumps([{"sku": sku, "on_hand": on_hand} for sku, on_hand in levels])
    if dialect == "postgresql":
        rows = sa.func.json_to_recordset(sa.cast(sa.literal(data), postgresql.JSON)).table_valued(
            sa.column("sku", sa.Text), sa.column("on_hand", sa.BigInteger)
        )
        return sa.select(rows.render_derived(name="l", with_types=True)).subquery("levels")
    each = sa.func.json_each(sa.literal(data)).table_valued("value")
    return sa.select(
        sa.func.json_extract(each.c.value, "$.sku").label("sku"),
        sa.func.json_extract(each.c.value, "$.on_hand").label("on_hand"),
    ).subquery("levels")


def add_skus(
    inventory: _Dialect, levels: Iterable[tuple[str, int]], *, skip_existing: bool = False
) -> Plan[AddedSkus]:
    """Create the stock rows of many SKUs in one transaction, each as :func:`add_sku` creates one (fence
    token 0, its creation in the history): ``levels`` is at most :data:`MAX_SKUS_ADDED` ``(sku, on_hand)``
    pairs, all checked before anything is written. A SKU that exists refuses them all (InvalidRequest,
    nothing written) unless ``skip_existing``, which leaves it as it is. Three statements, whatever the
    number of SKUs: which exist, the stock rows, their history rows."""
    checked = new_levels(levels)
    if not 1 <= len(checked) <= MAX_SKUS_ADDED:
        raise InvalidRequest(f"add 1 to {MAX_SKUS_ADDED} SKUs at once, not {len(checked)}", field="levels")
    found: Rows = yield sa.select(stock.c.sku).where(stock.c.sku.in_([sku for sku, _ in checked]))
    existing = sorted(row[0] for row in found.rows)
    if existing and not skip_existing:
        shown = ", ".join(repr(sku) for sku in existing[:5]) + (", ..." if len(existing) > 5 else "")
        raise InvalidRequest(f"{len(existing)} SKU(s) already exist: {shown}", field="sku")
    skipped = set(existing)
    new = [(sku, on_hand) for sku, on_hand in checked if sku not in skipped]
    if new:
        source = _json_levels(inventory.dialect, new)
        sku, units, zero = source.c.sku, source.c.on_hand, sa.literal(0)
        yield sa.insert(stock).from_select(
            ["sku", "on_hand", "reserved", "available", "fence_token", "updated_ms"],
            sa.select(sku, units, zero, units, zero, db_now_ms()),
        )
        created = (sa.literal("write"), sa.literal("create"), zero)  # kind, operation, token
        yield sa.insert(sku_history).from_select(
            ["sku", "at_ms", "kind", "operation", "token", "quantity", "on_hand_delta", "reserved_delta"],
            sa.select(sku, db_now_ms(), *created, units, units, zero),
        )
    added = [StockLevel(sku, on_hand, 0, on_hand, 0) for sku, on_hand in new]
    return AddedSkus(added=added, skipped=existing)


def purge_idempotency(*, older_than: float = DEFAULT_IDEMPOTENCY_RETENTION) -> Plan[int]:
    """Delete idempotency records older than ``older_than`` seconds (database clock)."""
    older_than_ms = round(valid.retention(older_than) * 1000)
    gone: Rows = yield (
        sa.delete(idempotency_keys)
        .where(idempotency_keys.c.created_ms < db_now_ms() - older_than_ms)
        .returning(idempotency_keys.c.key)
    )
    return len(gone.rows)
