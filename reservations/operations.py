"""The inventory's unfenced operations as plans: adding a SKU and purging old idempotency records. The
fenced writes are :mod:`reservations.lifecycle`'s (reservations), :mod:`reservations.on_hand`'s (restocks
and adjustments) and :mod:`reservations.counting`'s (counts and replenishment to par), each in the
envelope of :mod:`reservations.ledger`, alone or as queued requests through :mod:`reservations.keyed_steps`.
"""

from __future__ import annotations

import sqlalchemy as sa

from fencing.plan import Plan
from fencing.sql import Rows, db_now_ms
from reservations import validation as valid
from reservations.errors import InvalidRequest
from reservations.ledger import HeldLine, fingerprint, hold_ms_of, new_reservation_id
from reservations.models import idempotency_keys, sku_history, stock
from reservations.request_outcomes import DEFAULT_IDEMPOTENCY_RETENTION
from reservations.values import StockLevel

__all__ = ["HeldLine", "fingerprint", "hold_ms_of", "new_reservation_id"]


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


def purge_idempotency(*, older_than: float = DEFAULT_IDEMPOTENCY_RETENTION) -> Plan[int]:
    """Delete idempotency records older than ``older_than`` seconds (database clock)."""
    older_than_ms = round(valid.retention(older_than) * 1000)
    gone: Rows = yield (
        sa.delete(idempotency_keys)
        .where(idempotency_keys.c.created_ms < db_now_ms() - older_than_ms)
        .returning(idempotency_keys.c.key)
    )
    return len(gone.rows)
