"""The read side as plans: stock, reservations, per-SKU history and rejection counts, and the
invariant check an independent auditor (tests, the chaos checker, an operator) runs over the database.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from fencing.plan import Plan
from fencing.sql import Rows
from reservations import validation as valid
from reservations.errors import InvalidRequest, UnknownReservation, UnknownSku
from reservations.models import HELD, RESERVATION_STATUSES, reservations, sku_history, stock
from reservations.views import HistoryEntry, ReservationView, StockLevel

STOCK_COLUMNS = (stock.c.sku, stock.c.on_hand, stock.c.reserved, stock.c.available, stock.c.fence_token)


def _level(row: Any) -> StockLevel:
    return StockLevel(
        sku=row.sku,
        on_hand=row.on_hand,
        reserved=row.reserved,
        available=row.available,
        fence_token=row.fence_token,
    )


def _seconds(ms: int | None) -> float | None:
    return None if ms is None else ms / 1000


def _reservation(row: Any) -> ReservationView:
    return ReservationView(
        id=row.id,
        sku=row.sku,
        quantity=row.quantity,
        status=row.status,
        idempotency_key=row.idempotency_key,
        order_key=row.order_key,
        token=row.token,
        created_at=row.created_ms / 1000,
        hold_expires_at=_seconds(row.hold_expires_ms),
        final_at=_seconds(row.final_ms),
        final_token=row.final_token,
    )


def stock_level(sku: str) -> Plan[StockLevel]:
    valid.sku(sku)
    found: Rows = yield sa.select(*STOCK_COLUMNS).where(stock.c.sku == sku)
    row = found.first()
    if row is None:
        raise UnknownSku(sku)
    return _level(row)


def all_stock() -> Plan[list[StockLevel]]:
    found: Rows = yield sa.select(*STOCK_COLUMNS).order_by(stock.c.sku)
    return [_level(r) for r in found.rows]


def reservation(id_or_key: str) -> Plan[ReservationView]:
    """A reservation by id (``r_...``) or by the idempotency key that created it."""
    valid.reservation_ref(id_or_key)
    found: Rows = yield sa.select(reservations).where(
        sa.or_(reservations.c.id == id_or_key, reservations.c.idempotency_key == id_or_key)
    )
    row = found.first()
    if row is None:
        raise UnknownReservation(id_or_key)
    return _reservation(row)


def reservation_list(
    sku: str | None = None, *, status: str | None = None, order_key: str | None = None, limit: int = 100
) -> Plan[list[ReservationView]]:
    rows = valid.limit(limit)
    query = sa.select(reservations).order_by(reservations.c.created_ms, reservations.c.id).limit(rows)
    if sku is not None:
        query = query.where(reservations.c.sku == valid.sku(sku))
    if status is not None:
        if status not in RESERVATION_STATUSES:
            raise InvalidRequest(f"status must be one of {', '.join(RESERVATION_STATUSES)}", field="status")
        query = query.where(reservations.c.status == status)
    if order_key is not None:
        query = query.where(reservations.c.order_key == valid.idempotency_key(order_key))
    found: Rows = yield query
    return [_reservation(r) for r in found.rows]


def history(sku: str, *, limit: int = 1000, since: float | None = None) -> Plan[list[HistoryEntry]]:
    """A SKU's accepted writes and refused stale writes, oldest first (the newest ``limit``)."""
    query = sa.select(sku_history).where(sku_history.c.sku == valid.sku(sku))
    starting = valid.since(since)
    rows = valid.limit(limit)
    if starting is not None:
        query = query.where(sku_history.c.at_ms >= int(starting * 1000))
    found: Rows = yield query.order_by(sku_history.c.id.desc()).limit(rows)
    return [
        HistoryEntry(
            id=r.id,
            sku=r.sku,
            at=r.at_ms / 1000,
            kind=r.kind,
            operation=r.operation,
            token=r.token,
            lease_id=r.lease_id,
            holder=r.holder,
            quantity=r.quantity,
            idempotency_key=r.idempotency_key,
            reservation_id=r.reservation_id,
            on_hand_delta=r.on_hand_delta,
            reserved_delta=r.reserved_delta,
            highest_token=r.highest_token,
            detail=r.detail,
        )
        for r in reversed(found.rows)
    ]


def rejection_counts(since: float | None = None) -> Plan[dict[str, int]]:
    query = sa.select(sku_history.c.sku, sa.func.count()).where(sku_history.c.kind == "rejected")
    starting = valid.since(since)
    if starting is not None:
        query = query.where(sku_history.c.at_ms >= int(starting * 1000))
    found: Rows = yield query.group_by(sku_history.c.sku).order_by(sku_history.c.sku)
    return {r[0]: int(r[1]) for r in found.rows}


def invariant_violations() -> Plan[list[str]]:
    """Every broken invariant, as a sentence; an empty list means the inventory is consistent.

    Checks, per SKU: available >= 0; on_hand = available + reserved; reserved = units of held
    reservations; the history's deltas explain on_hand and reserved exactly; accepted writes never
    carry a token lower than an earlier accepted write; each idempotency key created one reservation.
    """
    problems: list[str] = []
    levels: Rows = yield sa.select(*STOCK_COLUMNS)
    held: Rows = yield (
        sa.select(reservations.c.sku, sa.func.sum(reservations.c.quantity))
        .where(reservations.c.status == HELD)
        .group_by(reservations.c.sku)
    )
    sums: Rows = yield (
        sa.select(
            sku_history.c.sku,
            sa.func.sum(sku_history.c.on_hand_delta),
            sa.func.sum(sku_history.c.reserved_delta),
        )
        .where(sku_history.c.kind == "write")
        .group_by(sku_history.c.sku)
    )
    held_by_sku = {r[0]: int(r[1]) for r in held.rows}
    sums_by_sku = {r[0]: (int(r[1]), int(r[2])) for r in sums.rows}
    for r in levels.rows:
        if r.available < 0:
            problems.append(f"{r.sku}: available is negative ({r.available})")
        if r.on_hand != r.available + r.reserved:
            problems.append(
                f"{r.sku}: on_hand {r.on_hand} != available {r.available} + reserved {r.reserved}"
            )
        if r.reserved != held_by_sku.get(r.sku, 0):
            problems.append(
                f"{r.sku}: reserved {r.reserved} != held reservations {held_by_sku.get(r.sku, 0)}"
            )
        if sums_by_sku.get(r.sku, (0, 0)) != (r.on_hand, r.reserved):
            problems.append(
                f"{r.sku}: history explains {sums_by_sku.get(r.sku)} not ({r.on_hand}, {r.reserved})"
            )
    writes: Rows = yield (
        sa.select(sku_history.c.sku, sku_history.c.token, sku_history.c.id)
        .where(sku_history.c.kind == "write", sku_history.c.operation != "create")
        .order_by(sku_history.c.sku, sku_history.c.id)
    )
    highest: dict[str, int] = {}
    for sku, token, entry in writes.rows:
        if token < highest.get(sku, 0):
            problems.append(f"{sku}: write #{entry} accepted with token {token} after token {highest[sku]}")
        highest[sku] = max(token, highest.get(sku, 0))
    dupes: Rows = yield (
        sa.select(sku_history.c.idempotency_key, sku_history.c.sku, sku_history.c.operation, sa.func.count())
        .where(
            sku_history.c.kind == "write",
            sku_history.c.idempotency_key.is_not(None),
            sku_history.c.operation.in_(("reserve", "reserve_many", "restock", "adjust")),
        )
        .group_by(sku_history.c.idempotency_key, sku_history.c.sku, sku_history.c.operation)
        .having(sa.func.count() > 1)
    )
    problems.extend(f"{r[1]}: key {r[0]!r} applied {r[3]} times by {r[2]}" for r in dupes.rows)
    return problems
