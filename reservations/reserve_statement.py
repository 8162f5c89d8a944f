"""A single-SKU reservation on PostgreSQL as ONE statement: one round trip, no open transaction.

The multi-statement plan in :mod:`reservations.operations` (lock, look up the key, fenced UPDATE, three
inserts, commit) stays the reference and the SQLite path; this is the same work and the same decisions
folded into one data-modifying CTE, sent in autocommit. Every guarantee stays in the statement itself:
the fence condition sits in the UPDATE's WHERE, the triggers still check every row, and a key inserted
concurrently fails the statement (nothing is written) so the next round replays it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fencing import Lease, StaleToken
from fencing.plan import Alone, Plan
from fencing.sql import Rows
from reservations.errors import InsufficientStock, UnknownSku
from reservations.views import Outcome, StockLevel

# The statement, read top to bottom:
#   prior     the key's idempotency record, if any (the statement's snapshot: a record committed while
#             this statement waits on the row lock is caught by the unique key instead).
#   cur       the SKU's stock row, locked FOR UPDATE; under READ COMMITTED a locking read returns the
#             newest version once a concurrent writer commits, so every decision below is made on the
#             row as it now is. Skipped when the key already has a record (a replay locks nothing).
#             ``accepted`` is the fence: a token above the highest, or equal from the same lease.
#   upd       the stock change, only when the token is accepted and the units are there.
#   held, written, recorded
#             the reservation, the history row and the idempotency record, each only if upd wrote.
#   refused   the key's refusal record when the token is accepted but the units are not there.
# The final SELECT returns one row that says which of these happened. A stale token writes nothing
# here; its rejection is recorded by the caller in a statement of its own, as on the other path.
_SQL = """
WITH prior AS (
    SELECT fingerprint, operation, outcome FROM idempotency_keys WHERE key = %(key)s::varchar
), cur AS (
    SELECT sku, available, fence_token,
           {accepted} AS accepted,
           available >= %(quantity)s::bigint AS enough,
           CAST(EXTRACT(EPOCH FROM statement_timestamp()) * 1000 AS BIGINT) AS now_ms
    FROM stock
    WHERE sku = %(sku)s::varchar AND NOT EXISTS (SELECT 1 FROM prior)
    FOR UPDATE
), upd AS (
    UPDATE stock AS s
    SET reserved = s.reserved + %(quantity)s::bigint,
        available = s.available - %(quantity)s::bigint,
        fence_token = %(token)s::bigint,
        fence_lease_id = %(lease_id)s::varchar,
        updated_ms = cur.now_ms
    FROM cur
    WHERE s.sku = cur.sku AND cur.accepted AND cur.enough
    RETURNING s.sku, s.on_hand, s.reserved, s.available, s.fence_token, cur.now_ms
), held AS (
    INSERT INTO reservations (id, sku, quantity, status, hold_expires_ms, idempotency_key, order_key,
                              token, lease_id, created_ms)
    SELECT %(reservation_id)s::varchar, sku, %(quantity)s::bigint, 'held',
           now_ms + %(hold_ms)s::bigint, %(key)s::varchar, NULL, %(token)s::bigint,
           %(lease_id)s::varchar, now_ms
    FROM upd
), written AS (
    INSERT INTO sku_history (sku, at_ms, kind, operation, token, lease_id, holder, quantity,
                             idempotency_key, reservation_id, on_hand_delta, reserved_delta)
    SELECT sku, now_ms, 'write', 'reserve', %(token)s::bigint, %(lease_id)s::varchar,
           %(holder)s::varchar, %(quantity)s::bigint, %(key)s::varchar, %(reservation_id)s::varchar,
           0, %(quantity)s::bigint
    FROM upd
), recorded AS (
    INSERT INTO idempotency_keys (key, fingerprint, operation, outcome, token, created_ms)
    SELECT %(key)s::varchar, %(fingerprint)s::varchar, 'reserve',
           json_build_object(
               'operation', 'reserve', 'key', %(key)s::text, 'token', %(token)s::bigint,
               'reservation_ids', json_build_array(%(reservation_id)s::text),
               'stock', json_build_array(json_build_object(
                   'sku', sku, 'on_hand', on_hand, 'reserved', reserved, 'available', available,
                   'fence_token', fence_token)),
               'quantity', %(quantity)s::bigint, 'detail', json_build_object())::text,
           %(token)s::bigint, now_ms
    FROM upd
), refused AS (
    INSERT INTO idempotency_keys (key, fingerprint, operation, outcome, token, created_ms)
    SELECT %(key)s::varchar, %(fingerprint)s::varchar, 'reserve',
           json_build_object('error', 'insufficient_stock', 'sku', sku,
                             'requested', %(quantity)s::bigint, 'available', available)::text,
           NULL, now_ms
    FROM cur
    WHERE cur.accepted AND NOT cur.enough
)
SELECT p.fingerprint AS prior_fingerprint, p.operation AS prior_operation, p.outcome AS prior_outcome,
       c.sku IS NOT NULL AS known, c.accepted, c.available AS seen_available, c.fence_token AS highest,
       u.sku IS NOT NULL AS applied, u.on_hand, u.reserved, u.available, u.fence_token
FROM (SELECT 1) AS one
LEFT JOIN prior AS p ON TRUE
LEFT JOIN cur AS c ON TRUE
LEFT JOIN upd AS u ON TRUE
"""

FENCED = _SQL.format(
    accepted="(fence_token < %(token)s::bigint"
    " OR (fence_token = %(token)s::bigint AND fence_lease_id = %(lease_id)s::varchar))"
)
# Lease-only: the token is written but not checked (for measuring what the fence prevents).
UNFENCED = _SQL.format(accepted="TRUE")


@dataclass(frozen=True, slots=True)
class Prior:
    """The key's idempotency record, as the replay logic reads it."""

    key: str
    fingerprint: str
    operation: str
    outcome: str


def reserve(
    lease: Lease,
    sku: str,
    quantity: int,
    *,
    key: str,
    fingerprint: str,
    hold_ms: int | None,
    reservation_id: str,
    enforce: bool,
) -> Plan[Outcome | Prior]:
    """Send the statement; return the applied outcome or the key's record to replay.

    Raises :class:`UnknownSku`, :class:`InsufficientStock` (its refusal already recorded under the key)
    or :class:`StaleToken` (nothing written; the lease is marked lost).
    """
    found: Rows = yield Alone(
        FENCED if enforce else UNFENCED,
        {
            "key": key,
            "sku": sku,
            "quantity": quantity,
            "token": lease.token,
            "lease_id": lease.lease_id,
            "holder": lease.holder,
            "hold_ms": hold_ms,
            "reservation_id": reservation_id,
            "fingerprint": fingerprint,
        },
    )
    row: Any = found.rows[0]
    if row.prior_fingerprint is not None:
        return Prior(key, row.prior_fingerprint, row.prior_operation, row.prior_outcome)
    if not row.known:
        raise UnknownSku(sku)
    if row.applied:
        level = StockLevel(sku, row.on_hand, row.reserved, row.available, row.fence_token)
        return Outcome(
            operation="reserve",
            key=key,
            token=lease.token,
            reservation_ids=(reservation_id,),
            stock=(level,),
            quantity=quantity,
        )
    if not row.accepted:
        lease.mark_lost(f"reserve rejected: resource accepted token {row.highest}")
        raise StaleToken(
            scope=lease.scope,
            presented=lease.token,
            highest=int(row.highest),
            lease_id=lease.lease_id,
            holder=lease.holder,
        )
    raise InsufficientStock(sku=sku, requested=quantity, available=int(row.seen_available))
