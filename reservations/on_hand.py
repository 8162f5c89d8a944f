"""Writes of on-hand stock by a figure sent: a restock (units in) and an adjustment (units in or out, with
a reason). Each is a fenced write in the ledger's envelope; a restock is also sent as one statement on
PostgreSQL (:mod:`reservations.stock_statement`).
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

from fencing import Lease
from fencing.plan import Plan
from reservations import keyed_statement as keyed
from reservations import stock_statement
from reservations import validation as valid
from reservations.keyed_steps import Step
from reservations.ledger import Ledger, Shell, fingerprint
from reservations.models import stock
from reservations.statuses import SUCCEEDED
from reservations.stock_statement import Change
from reservations.values import Outcome


def restock_step(ledger: Ledger, lease: Lease, sku: str, quantity: int, key: str) -> Step:
    """A restock, checked, both ways it can be sent."""
    valid.lease(lease)
    valid.sku(sku)
    valid.quantity(quantity)
    valid.idempotency_key(key)
    print_ = fingerprint("restock", sku=sku, delta=quantity, reason=None)
    written = keyed.Written(lease, key, "restock", print_, SUCCEEDED["restock"])
    several = partial(change_on_hand, ledger, lease, sku, quantity, key, "restock", print_)

    rejection = partial(
        ledger.rejection, lease=lease, sku=sku, operation="restock", key=key, quantity=quantity
    )
    return stock_statement.step(ledger.fence, written, sku, Change.ADD, quantity, several, rejection)


def adjust(
    inventory: Shell, lease: Lease, sku: str, delta: int, *, key: str, reason: str | None = None
) -> Plan[Outcome]:
    valid.lease(lease)
    valid.sku(sku)
    valid.delta(delta)
    valid.idempotency_key(key)
    valid.text(reason, field="reason", max_chars=valid.MAX_REASON_CHARS)
    print_ = fingerprint("adjust", sku=sku, delta=delta, reason=reason)
    return change_on_hand(inventory.ledger, lease, sku, delta, key, "adjust", print_, reason=reason)


def change_on_hand(
    ledger: Ledger, lease: Lease, sku: str, delta: int, key: str, operation: str, print_: str, *,
    reason: str | None = None, detail: dict[str, Any] | None = None,
) -> Plan[Outcome]:  # fmt: skip
    """Units in (``delta`` of 0 or more) or out, in the ledger's envelope: a restock, an adjustment with its
    ``reason``, or a replenishment with the ``detail`` of what it was decided from."""

    def apply() -> Plan[Outcome]:
        condition = None if delta >= 0 else stock.c.available >= -delta
        level = yield from ledger.fenced(lease, sku, operation, on_hand=delta, condition=condition)
        noted = reason if detail is None else json.dumps(detail, sort_keys=True)
        yield ledger.history(lease, sku, operation, key, quantity=delta, on_hand=delta, detail=noted)
        return Outcome(
            operation=operation,
            key=key,
            token=lease.token,
            stock=(level,),
            quantity=delta,
            detail=detail or {},
        )

    rejection = partial(ledger.rejection, lease=lease, sku=sku, operation=operation, key=key, quantity=delta)
    return ledger.idempotent(key, operation, print_, apply, rejection, ledger.lock_skus(sku))
