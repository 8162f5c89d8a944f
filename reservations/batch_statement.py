"""The writes of a hot SKU's batch on PostgreSQL as ONE statement, inside the batch's transaction
(docs/architecture.md, "A hot SKU: requests served in batches by the lease holder", step 2).

:mod:`reservations.batching` decides each request against the locked stock row; this writes what it
decided. Five multi-row inserts, an update and a delete were as many round trips, each compiled again for
its number of rows; here the rows travel as JSON arrays in a statement sent as it is, so it has one text
for a batch of any size.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fencing import Fence, Lease
from fencing.plan import Bound, Plan
from fencing.sql import Rows
from reservations import ledger, sql_text
from reservations import request_outcomes as outcomes
from reservations.ledger import HeldLine
from reservations.models import HELD, stock
from reservations.request_outcomes import RequestResult, result_of

# clock    the database's time, once for every row of the statement.
# upd      the stock change for the units held, only under a token the fence admits and while the units
#          are there (the batch decided against the row it locked, so this holds unless that decision
#          was wrong); nothing to change when nothing is held.
# ok       whether the change the batch decided was made: every other write is made only then, so a
#          refusal here writes nothing and the caller's transaction rolls back.
_SQL = """
WITH clock AS (
    SELECT {now_ms} AS now_ms
), held AS (
    SELECT * FROM json_to_recordset(%(held)s::json) AS h(id text, key text, quantity bigint, hold_ms bigint)
), upd AS (
    UPDATE stock
    SET reserved = reserved + %(total)s::bigint, available = available - %(total)s::bigint,
        updated_ms = (SELECT now_ms FROM clock), fence_token = %(token)s::bigint,
        fence_lease_id = %(lease_id)s::text
    WHERE sku = %(sku)s::text AND %(total)s::bigint > 0 AND {accepted}
      AND available >= %(total)s::bigint
    RETURNING sku
), ok AS (
    SELECT %(total)s::bigint = 0 OR EXISTS (SELECT 1 FROM upd) AS ok
), kept AS (
    INSERT INTO reservations (id, sku, quantity, status, hold_expires_ms, idempotency_key, order_key, token,
                              lease_id, created_ms)
    SELECT h.id, %(sku)s::text, h.quantity, %(status)s::text, c.now_ms + h.hold_ms, h.key, NULL,
           %(token)s::bigint, %(lease_id)s::text, c.now_ms
    FROM held AS h, clock AS c WHERE EXISTS (SELECT 1 FROM upd)
), written AS (
    INSERT INTO sku_history (sku, at_ms, kind, operation, token, lease_id, holder, quantity, idempotency_key,
                             reservation_id, on_hand_delta, reserved_delta, highest_token, detail)
    SELECT %(sku)s::text, c.now_ms, 'write', 'reserve', %(token)s::bigint, %(lease_id)s::text,
           %(holder)s::text, h.quantity, h.key, h.id, 0, h.quantity, NULL, NULL
    FROM held AS h, clock AS c WHERE EXISTS (SELECT 1 FROM upd)
), recorded AS (
    {recorded}
), told AS (
    {told}
), tried AS (
    {tried}
), gone AS (
    DELETE FROM pending_reservations WHERE key = ANY(%(listed)s::text[]) AND (SELECT ok FROM ok)
)
SELECT ok.ok, t.key, t.operation, t.status, t.detail, t.task_id, t.worker, t.epochs, t.at_ms, t.fingerprint
FROM ok LEFT JOIN told AS t ON TRUE
"""

_PARTS = {
    "now_ms": sql_text.NOW_MS,
    "recorded": ledger.BATCHED,
    "told": outcomes.BATCH_TOLD,
    "tried": outcomes.BATCH_TRIED,
}
WRITE = _SQL.format(**_PARTS, accepted=sql_text.fence_admits(Fence(stock)))
# Lease-only: the token is written but not checked (for measuring what the fence prevents).
UNFENCED = _SQL.format(**_PARTS, accepted="TRUE")


@dataclass(frozen=True, slots=True)
class InHand:
    """A reservation request handed to the batch's server by a thread of its own process, never written to
    the pending list: served after the list's requests, in the order handed, as if it had waited there."""

    key: str
    sku: str
    quantity: int
    hold_ms: int | None
    task_id: str | None
    epochs: int


# The SKU's oldest listed requests, then those in hand (a JSON array, in the order handed), each with
# whether it ended elsewhere, its idempotency record if it has one, and whether a reservation holds its key:
# what the batch decides on, read after it locked the stock row (so under that lock, in a snapshot of its
# own), in one text whatever the number in hand.
WAITING = """
WITH queue AS (
    (SELECT key, quantity, hold_ms, task_id, epochs, id AS place FROM pending_reservations
     WHERE sku = %(sku)s::text ORDER BY id LIMIT %(limit)s::bigint)
    UNION ALL
    SELECT key, quantity, hold_ms, task_id, epochs, -n
    FROM json_to_recordset(%(in_hand)s::json)
         AS h(key text, quantity bigint, hold_ms bigint, task_id text, epochs int, n bigint)
)
SELECT q.key, %(sku)s::text AS sku, q.quantity, q.hold_ms, q.task_id, q.epochs,
       o.key IS NOT NULL AS ended, r.fingerprint AS stored_fingerprint, r.operation AS stored_operation,
       r.outcome AS stored_outcome,
       EXISTS (SELECT 1 FROM reservations AS v WHERE v.idempotency_key = q.key) AS clashing
FROM queue AS q
LEFT JOIN request_outcomes AS o ON o.key = q.key
LEFT JOIN idempotency_keys AS r ON r.key = q.key
ORDER BY q.place < 0, abs(q.place)
"""


def waiting(sku: str, limit: int, in_hand: Sequence[InHand]) -> Plan[list[Any]]:
    """The requests a batch decides on (:data:`WAITING`), in arrival order: listed, then in hand."""
    handed = [
        {"key": r.key, "quantity": r.quantity, "hold_ms": r.hold_ms, "task_id": r.task_id, "epochs": r.epochs,
         "n": n}
        for n, r in enumerate(in_hand, start=1)
    ]  # fmt: skip
    found: Rows = yield Bound(WAITING, {"sku": sku, "limit": limit, "in_hand": json.dumps(handed)})
    return found.rows


class NotWritten(RuntimeError):
    """The stock change a batch decided against the row it locked was refused: a bug, never a refusal
    of a request (the transaction rolls back, and its requests stay where they were)."""


def write(
    fence: Fence,
    lease: Lease,
    sku: str,
    held: Sequence[HeldLine],
    records: list[dict[str, Any]],
    outcomes: list[dict[str, Any]],
    attempts: list[dict[str, Any]],
    listed: list[str],
) -> Plan[list[RequestResult]]:
    """Write what the batch decided (the rows' times are the statement's); the outcome rows as written.

    ``records``, ``outcomes`` and ``attempts`` are the rows of idempotency_keys, request_outcomes and
    task_attempts without their time; ``listed`` the keys to remove from the pending list."""
    found: Rows = yield Bound(
        WRITE if fence.enforce else UNFENCED,
        {
            "sku": sku,
            "token": lease.token,
            "lease_id": lease.lease_id,
            "holder": lease.holder,
            "status": HELD,
            "total": sum(line.quantity for line in held),
            "held": json.dumps(
                [
                    {
                        "id": line.reservation_id,
                        "key": line.key,
                        "quantity": line.quantity,
                        "hold_ms": line.hold_ms,
                    }
                    for line in held
                ]
            ),
            "records": json.dumps(records),
            "outcomes": json.dumps(outcomes),
            "attempts": json.dumps(attempts),
            "listed": listed,
        },
    )
    if not found.rows[0].ok:
        raise NotWritten(f"the batch's change of {sku!r} was refused by the row it had locked")
    return [result_of(row) for row in found.rows if row.key is not None]
