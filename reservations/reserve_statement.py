"""A single-SKU reservation on PostgreSQL as ONE statement: one round trip, no open transaction.

The work and decisions of the multi-statement plan (:func:`reservations.lifecycle.reserve_step`'s
``several``: lock, look up the key, fenced UPDATE, three inserts, commit) folded into one data-modifying
CTE sent in autocommit; why the plan stays beside it: docs/architecture.md, "One statement and the
portable plan". Every guarantee stays in the statement itself: the fence condition sits in the UPDATE's
WHERE, the triggers still check every row, and a key whose record or outcome was inserted concurrently
fails the statement on a unique key (nothing is written), so the next round answers from what that writer
stored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeAlias

from fencing import Fence, Lease
from fencing.plan import Alone, Plan
from fencing.sql import Rows
from reservations import ledger, sql_text
from reservations import request_outcomes as outcomes
from reservations.errors import InsufficientStock, UnknownSku
from reservations.models import stock
from reservations.request_outcomes import RequestResult, result_from_json
from reservations.statuses import RequestStatus
from reservations.values import Outcome, StockLevel

# The statement, read top to bottom (done and prior as in reservations.keyed_statement's HEAD):
#   cur       the SKU's stock row, locked FOR UPDATE; under READ COMMITTED a locking read returns the
#             newest version once a concurrent writer commits, so every decision below is made on the
#             row as it now is. Skipped when the key already has a record (a replay locks nothing).
#             ``accepted`` is the fence: a token above the highest, or equal from the same lease.
#   upd       the stock change, only when the token is accepted and the units are there.
#   held, written, recorded
#             the reservation, the history row and the idempotency record, each only if upd wrote.
#   refused   the key's refusal record when the token is accepted but the units are not there.
#   told, tried
#             with ``record``: the request's final outcome (reserved or insufficient_stock) and its
#             applied attempt, in the same statement as the change they report.
# done, told and tried are the statement's speaking parts (:data:`_SPEAKING`). The final SELECT returns
# one row that says which of these happened (the rare answers as JSON: every column costs the client
# time). A stale token writes nothing here; the caller records its rejection in a statement of its own.
# What the record, outcome and attempt written with a reservation know as SQL (see reservations.ledger):
_KNOWN = {
    "operation": "'reserve'",
    "status": "'reserved'",
    "reservation_ids": "json_build_array(%(reservation_id)s::text)",
    "quantity": "%(quantity)s::bigint",
    "detail": "json_build_object()",
}
_SQL = """
WITH {done}prior AS (
    {prior}{unless_done}
), cur AS (
    SELECT sku, available, fence_token, fence_lease_id,
           {accepted} AS accepted,
           available >= %(quantity)s::bigint AS enough,
           {now_ms} AS now_ms
    FROM stock
    WHERE sku = %(sku)s::text AND NOT EXISTS (SELECT 1 FROM prior){unless_done}
    FOR UPDATE
), upd AS (
    UPDATE stock AS s
    SET reserved = s.reserved + %(quantity)s::bigint,
        available = s.available - %(quantity)s::bigint,
        fence_token = %(token)s::bigint,
        fence_lease_id = %(lease_id)s::text,
        updated_ms = cur.now_ms
    FROM cur
    WHERE s.sku = cur.sku AND cur.accepted AND cur.enough
    RETURNING s.sku, s.on_hand, s.reserved, s.available, s.fence_token, cur.now_ms
), held AS (
    INSERT INTO reservations (id, sku, quantity, status, hold_expires_ms, idempotency_key, order_key,
                              token, lease_id, created_ms)
    SELECT %(reservation_id)s::text, sku, %(quantity)s::bigint, 'held',
           now_ms + %(hold_ms)s::bigint, %(key)s::text, NULL, %(token)s::bigint,
           %(lease_id)s::text, now_ms
    FROM upd
), written AS (
    INSERT INTO sku_history (sku, at_ms, kind, operation, token, lease_id, holder, quantity,
                             idempotency_key, reservation_id, on_hand_delta, reserved_delta)
    SELECT sku, now_ms, 'write', 'reserve', %(token)s::bigint, %(lease_id)s::text,
           %(holder)s::text, %(quantity)s::bigint, %(key)s::text, %(reservation_id)s::text,
           0, %(quantity)s::bigint
    FROM upd
), recorded AS (
    {recorded}
), refused AS (
    {refused}
)
{spoken}SELECT {done_json} AS done, row_to_json(p)::text AS prior,
       c.sku IS NOT NULL AS known, c.accepted, c.available AS seen_available, c.fence_token AS highest,
       c.fence_lease_id AS writer,
       c.now_ms, u.sku IS NOT NULL AS applied, u.on_hand, u.reserved, u.available, u.fence_token
FROM (SELECT 1) AS one
{join_done}LEFT JOIN prior AS p ON TRUE
LEFT JOIN cur AS c ON TRUE
LEFT JOIN upd AS u ON TRUE
"""

# The parts only a statement speaking for a queued request has: its final outcome read first (``done``),
# and its outcome and attempt written with the change (``told``, ``tried``).
_SPEAKING = {
    "done": f"done AS ({outcomes.DONE}), ",
    "unless_done": " AND NOT EXISTS (SELECT 1 FROM done)",
    "spoken": f", told AS ({outcomes.told(_KNOWN, short=True)})"
    f", tried AS ({outcomes.tried(_KNOWN['operation'])})\n",
    "done_json": "row_to_json(d)::text",
    "join_done": "LEFT JOIN done AS d ON TRUE\n",
}
# Without them (no request speaks: Inventory.reserve): two tables fewer for the database to open and four
# parameters fewer to send, read the same way (``done`` is always NULL).
_PLAIN = {"done": "", "unless_done": "", "spoken": "", "done_json": "NULL::text", "join_done": ""}

# The fence predicate and the database clock come from fencing (reservations.sql_text renders them);
# lease-only, the token is written but not checked (for measuring what the fence prevents).
STATEMENTS = sql_text.variants(
    lambda fenced, speaking: _SQL.format(
        accepted=sql_text.fence_admits(Fence(stock)) if fenced else "TRUE",
        now_ms=sql_text.NOW_MS,
        prior=ledger.PRIOR,
        recorded=ledger.recorded(**_KNOWN),
        refused=ledger.SHORT,
        **(_SPEAKING if speaking else _PLAIN),
    )
)


@dataclass(frozen=True, slots=True)
class Prior:
    """The key's idempotency record, as the replay logic reads it."""

    key: str
    fingerprint: str
    operation: str
    outcome: str


@dataclass(frozen=True, slots=True)
class Speaker:
    """Who the statement speaks for when it also records the request's outcome and attempt."""

    task_id: str | None
    worker: str | None
    epochs: int

    def told(
        self, key: str, operation: str, fingerprint: str, status: str, detail: dict[str, Any], now_ms: int
    ) -> RequestResult:
        """The request's final outcome, as the statement speaking for it wrote it at ``now_ms``."""
        return RequestResult(
            key, operation, status, detail, self.task_id, self.worker, self.epochs, now_ms / 1000, fingerprint
        )


@dataclass(frozen=True, slots=True)
class Ended:
    """The request had already ended (a statement speaking for a queued request): its outcome."""

    result: RequestResult


@dataclass(frozen=True, slots=True)
class Replay:
    """The key had an idempotency record: nothing was written, the record is to be replayed."""

    prior: Prior


@dataclass(frozen=True, slots=True)
class Applied:
    """The write was made and recorded; with a speaker, ``told`` is the outcome row written with it."""

    outcome: Outcome
    told: RequestResult | None


@dataclass(frozen=True, slots=True)
class Short:
    """The token was accepted but the units were not there: the refusal is recorded under the key;
    with a speaker, ``told`` is the outcome row written with it."""

    refused: InsufficientStock
    told: RequestResult | None


# What a one-statement write did: exactly one of these (a stale token raises instead; only a reservation
# answers Short).
Reply: TypeAlias = Ended | Replay | Applied | Short


def read_head(row: Any, key: str) -> Ended | Replay | None:
    """The answer of a request that had ended, or of a key that had a record (nothing was written)."""
    if row.done is not None:
        return Ended(result_from_json(row.done))
    if row.prior is not None:
        prior = json.loads(row.prior)
        return Replay(Prior(key, prior["fingerprint"], prior["operation"], prior["outcome"]))
    return None


def exchange(
    lease: Lease, sku: str, quantity: int, key: str, print_: str, hold_ms: int | None, fence: Fence,
    speaker: Speaker | None,
) -> Plan[Reply]:  # fmt: skip
    """Send the reservation's statement (the variant for ``fence`` and ``speaker``) and read its one row.
    Raises :class:`UnknownSku` or :class:`~fencing.StaleToken` (nothing written; the fence marks the lease
    lost). A refusal for lack of units comes back as :class:`Short`, already recorded under the key."""
    reservation_id = ledger.new_reservation_id()
    values = {
        "key": key, "sku": sku, "quantity": quantity, "token": lease.token, "lease_id": lease.lease_id,
        "holder": lease.holder, "hold_ms": hold_ms, "reservation_id": reservation_id, "fingerprint": print_,
        "record": True,
    }  # fmt: skip
    if speaker is not None:
        values.update(task_id=speaker.task_id, worker=speaker.worker, epochs=speaker.epochs)
    statement = STATEMENTS[(fence.enforce, speaker is not None)]
    found: Rows = yield Alone(statement.text, statement.bind(values))
    row: Any = found.rows[0]
    head = read_head(row, key)
    if head is not None:
        return head
    if not row.known:
        raise UnknownSku(sku)

    def told(status: str, detail: dict[str, Any]) -> RequestResult | None:
        return None if speaker is None else speaker.told(key, "reserve", print_, status, detail, row.now_ms)

    if row.applied:
        level = StockLevel(sku, row.on_hand, row.reserved, row.available, row.fence_token)
        outcome = Outcome.reserved(key, lease.token, reservation_id, level, quantity)
        return Applied(outcome, told(RequestStatus.RESERVED, outcome.summary()))
    if not row.accepted:
        # The statement judged the token by the fence's own predicate; the fence raises the error.
        fence.refuse_if_stale(lease, lease.scope, int(row.highest), row.writer, "reserve")
        raise RuntimeError(f"the fence refused token {lease.token} and admitted it")  # pragma: no cover
    short = InsufficientStock(sku=sku, requested=quantity, available=int(row.seen_available))
    return Short(short, told(RequestStatus.INSUFFICIENT_STOCK, short.summary()))
