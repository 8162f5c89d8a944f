"""What the tests of the later steps as one statement share: the SKUs and the speaker they use, leases
of one epoch and the next, and every row the steps write, read without clocks, lease ids and row ids.
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from fencing import Lease, LeaseManager
from fencing.engines import make_engine
from reservations import scope_of

WIDGET, GADGET, BIG, NOPE = "WIDGET", "GADGET", "BIG", "NOPE"
WHO: dict[str, Any] = {"task_id": "task-1", "worker": "worker-1", "epochs": 1}  # whom a request speaks for
UNKNOWN = "r_" + "0" * 32


def lease_for(leases: LeaseManager, sku: str, holder: str) -> Lease:
    return leases.acquire(scope_of(sku), ttl=60, holder=holder)


def newer_epoch(leases: LeaseManager, stale: Lease, holder: str) -> Lease:
    """The next epoch of ``stale``'s scope, its lease broken by an operator: ``stale`` does not know."""
    leases.break_lease(stale.scope, reason="a newer epoch takes over")
    return leases.acquire(stale.scope, ttl=60, holder=holder)


def rows(url: str) -> dict[str, Any]:
    """Every row the steps write, without clocks, lease ids and row ids."""
    engine = make_engine(url)
    with engine.connect() as conn:

        def read(sql: str) -> list[dict[str, Any]]:
            return [dict(row._mapping) for row in conn.execute(sa.text(sql))]

        found = {
            "stock": read("SELECT sku, on_hand, reserved, available, fence_token FROM stock ORDER BY sku"),
            "reservations": read(
                "SELECT id, sku, quantity, status, idempotency_key, token, final_token, final_key,"
                " final_ms IS NOT NULL AS ended FROM reservations ORDER BY created_ms, idempotency_key"
            ),
            "history": read(
                "SELECT sku, kind, operation, token, holder, quantity, idempotency_key, reservation_id,"
                " on_hand_delta, reserved_delta, highest_token, detail FROM sku_history ORDER BY id"
            ),
            "keys": read(
                "SELECT key, fingerprint, operation, outcome, token FROM idempotency_keys ORDER BY key"
            ),
            "outcomes": read(
                "SELECT key, operation, status, detail, task_id, worker, epochs, fingerprint"
                " FROM request_outcomes ORDER BY key"
            ),
            "attempts": read(
                "SELECT key, operation, result, task_id, worker, token, detail FROM task_attempts ORDER BY id"
            ),
        }
    engine.dispose()
    for row in found["keys"]:
        row["outcome"] = json.loads(row["outcome"])
    for row in found["outcomes"]:
        row["detail"] = json.loads(row["detail"])
    return found
