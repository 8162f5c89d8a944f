"""The read side as plans: stock, reservations, per-SKU history and rejection counts. The invariant
check lives in :mod:`reservations.audit`.

Each read the inventory offers is one statement, sent :class:`~fencing.plan.Alone`: in autocommit on
PostgreSQL, one round trip where a transaction around it would add its BEGIN and COMMIT. A write's own
read of its stock row (:func:`stock_level` from a plan) stays in the write's transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from fencing.plan import Alone, Plan
from fencing.sql import Rows
from reservations import validation as valid
from reservations.errors import InvalidRequest, UnknownReservation, UnknownSku
from reservations.models import RESERVATION_STATUSES, reservations, sku_checkpoints, sku_history, stock
from reservations.values import ArchivedHistory, HistoryEntry, ReservationView, StockLevel, columns, seconds

# SKUs looked up by one existing_skus (one IN list).
MAX_SKUS_READ = 1_000

STOCK_COLUMNS = (stock.c.sku, stock.c.on_hand, stock.c.reserved, stock.c.available, stock.c.fence_token)

# Each SKU's newest checkpoint (reservations.archive): what of its history was archived, and where its
# audit starts.
_NEWEST = (
    sa.select(sku_checkpoints.c.sku, sa.func.max(sku_checkpoints.c.through_ms).label("through_ms"))
    .group_by(sku_checkpoints.c.sku)
    .subquery()
)
NEWEST_CHECKPOINTS = sa.select(sku_checkpoints).join(
    _NEWEST,
    sa.and_(sku_checkpoints.c.sku == _NEWEST.c.sku, sku_checkpoints.c.through_ms == _NEWEST.c.through_ms),
)


_STOCK_OF = sa.select(*STOCK_COLUMNS).where(stock.c.sku == sa.bindparam("sku"))
# A reservation by id or by the key that made it, built once: sent with its value, on the driver's cursor.
_BY_REF = sa.select(reservations).where(
    sa.or_(reservations.c.id == sa.bindparam("ref"), reservations.c.idempotency_key == sa.bindparam("ref"))
)


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
        hold_expires_at=seconds(row.hold_expires_ms),
        final_at=seconds(row.final_ms),
        final_token=row.final_token,
    )


def stock_level(sku: str) -> Plan[StockLevel]:
    """A SKU's stock, read in the transaction of the plan that reads it."""
    valid.sku(sku)
    found: Rows = yield sa.select(*STOCK_COLUMNS).where(stock.c.sku == sku)
    return _level(sku, found)


def stock_alone(sku: str) -> Plan[StockLevel]:
    """A SKU's stock: on hand, reserved, available and the token of its last write."""
    found: Rows = yield Alone(_STOCK_OF, {"sku": valid.sku(sku)})
    return _level(sku, found)


def _level(sku: str, found: Rows) -> StockLevel:
    row = found.first()
    if row is None:
        raise UnknownSku(sku)
    return StockLevel(*row)


def all_stock(
    *, after: str | None = None, limit: int | None = None, prefix: str | None = None
) -> Plan[list[StockLevel]]:
    """Every SKU's stock in SKU order, or a page of it: those after the SKU ``after``, at most ``limit``,
    whose SKU starts with ``prefix``."""
    query = sa.select(*STOCK_COLUMNS).order_by(stock.c.sku)
    if after is not None:
        query = query.where(stock.c.sku > valid.sku(after))
    if prefix is not None:
        query = query.where(stock.c.sku.startswith(valid.sku(prefix), autoescape=True))
    if limit is not None:
        query = query.limit(valid.whole(limit, "limit", 1, 2**63 - 1))
    found: Rows = yield Alone(query)
    return [StockLevel(*r) for r in found.rows]


def existing_skus(skus: Sequence[str]) -> Plan[list[str]]:
    """Those of ``skus`` (at most :data:`~reservations.operations.MAX_SKUS_ADDED`) that have a stock row,
    in SKU order: one read, for a bulk import to refuse before it writes anything."""
    names = [valid.sku(sku) for sku in skus]
    if len(names) > MAX_SKUS_READ:
        raise InvalidRequest(f"look up at most {MAX_SKUS_READ} SKUs at once", field="skus")
    found: Rows = yield Alone(sa.select(stock.c.sku).where(stock.c.sku.in_(names)).order_by(stock.c.sku))
    return [row[0] for row in found.rows]


def sku_count(*, prefix: str | None = None) -> Plan[int]:
    """How many SKUs have a stock row (whose SKU starts with ``prefix``)."""
    query = sa.select(sa.func.count()).select_from(stock)
    if prefix is not None:
        query = query.where(stock.c.sku.startswith(valid.sku(prefix), autoescape=True))
    found: Rows = yield Alone(query)
    return int(found.first()[0])


def reservation(id_or_key: str) -> Plan[ReservationView]:
    """A reservation by id (``r_...``) or by the idempotency key that created it."""
    valid.reservation_ref(id_or_key)
    found: Rows = yield Alone(_BY_REF, {"ref": id_or_key})
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
    found: Rows = yield Alone(query)
    return [_reservation(r) for r in found.rows]


def history(sku: str, *, limit: int = 1000, since: float | None = None) -> Plan[list[HistoryEntry]]:
    """A SKU's accepted writes and refused stale writes, oldest first (the newest ``limit``)."""
    query = sa.select(sku_history).where(sku_history.c.sku == valid.sku(sku))
    starting = valid.since(since)
    rows = valid.limit(limit)
    if starting is not None:
        query = query.where(sku_history.c.at_ms >= int(starting * 1000))
    found: Rows = yield Alone(query.order_by(sku_history.c.id.desc()).limit(rows))
    return [HistoryEntry(**columns(r)) for r in reversed(found.rows)]


def archived(sku: str) -> Plan[ArchivedHistory | None]:
    """The SKU's history that was archived, as its newest checkpoint sums it up; None if none was."""
    found: Rows = yield Alone(NEWEST_CHECKPOINTS.where(sku_checkpoints.c.sku == valid.sku(sku)))
    row = found.first()
    if row is None:
        return None
    through, archived_at = row.through_ms / 1000, row.archived_ms / 1000
    return ArchivedHistory(
        row.sku, through, row.on_hand, row.reserved, row.highest_token, archived_at, row.archive
    )


def rejection_counts(*, since: float | None = None) -> Plan[dict[str, int]]:
    query = sa.select(sku_history.c.sku, sa.func.count()).where(sku_history.c.kind == "rejected")
    starting = valid.since(since)
    if starting is not None:
        query = query.where(sku_history.c.at_ms >= int(starting * 1000))
    found: Rows = yield Alone(query.group_by(sku_history.c.sku).order_by(sku_history.c.sku))
    return {r[0]: int(r[1]) for r in found.rows}
