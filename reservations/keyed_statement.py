"""A later fenced write under an idempotency key as ONE statement: the parts every such statement shares.

:mod:`reservations.finish_statement` (confirm, release) and :mod:`reservations.stock_statement` (restock,
replenish, count) fold the ledger's envelope into one data-modifying CTE sent in autocommit, as
:mod:`reservations.reserve_statement` does for a reservation and with the same answer to a concurrent
copy of the key: the :data:`HEAD`, the write of its own that ends in a CTE named ``upd``, and the
:data:`TAIL` written only when ``upd`` wrote.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from fencing import Fence, Lease
from fencing.plan import Alone, Plan
from fencing.sql import Rows
from reservations import ledger, sql_text
from reservations import request_outcomes as outcomes
from reservations.models import stock
from reservations.reserve_statement import Applied, Ended, Replay, Speaker, read_head
from reservations.sql_text import Variants
from reservations.values import Outcome, StockLevel

# done    the request's final outcome, when the statement speaks for a queued request (``record``): a
#         request that already ended is answered from it and nothing else happens.
# prior   the key's idempotency record (on the statement's snapshot: one committed while the statement
#         waits on a row lock is caught by the unique key instead).
_READS = {"done": outcomes.DONE, "prior": ledger.PRIOR}
_HEAD = """
done AS ({done}), prior AS (
    {prior} AND NOT EXISTS (SELECT 1 FROM done)
)"""
HEAD = _HEAD.format(**_READS)

# What ``upd`` returns: the stock row after the write (sku, on_hand, reserved, available, fence_token),
# the database clock (now_ms), the units the write moved as its history and outcome name them (quantity)
# and its change to on hand and reserved (on_hand_delta, reserved_delta). Then the history row
# (``written``), the idempotency record and, with ``record``, the request's outcome and applied attempt.
_KNOWN = {
    "operation": "%(operation)s::text",
    "status": "%(status)s::text",
    "reservation_ids": "%(reservation_ids)s::json",
    "quantity": "quantity",
    "detail": "%(detail)s::json",
}
_WRITES = """
written AS (
    INSERT INTO sku_history (sku, at_ms, kind, operation, token, lease_id, holder, quantity,
                             idempotency_key, reservation_id, on_hand_delta, reserved_delta, detail)
    SELECT sku, now_ms, 'write', %(operation)s::text, %(token)s::bigint, %(lease_id)s::text,
           %(holder)s::text, quantity, %(key)s::text, %(reservation_id)s::text, on_hand_delta,
           reserved_delta, %(history_detail)s::text
    FROM upd
), recorded AS ({recorded})"""
TAIL_PLAIN = _WRITES.format(recorded=ledger.recorded(**_KNOWN))
TAIL = (
    TAIL_PLAIN
    + f", told AS ({outcomes.told(_KNOWN)})"
    + f", tried AS ({outcomes.tried(_KNOWN['operation'])})"
)

# For a step no queued request speaks through (the shells' confirm, restock, ...): no outcome to read
# first and none to write, so two tables fewer for the database to open and four parameters fewer to send;
# the statement reads the same way (``done`` is empty).
_HEAD_PLAIN = """
done AS (
    SELECT * FROM request_outcomes WHERE FALSE
), prior AS ({prior})"""
HEAD_PLAIN = _HEAD_PLAIN.format(**_READS)

# The columns of the final SELECT that every such statement returns, from ``done``, ``prior`` and
# ``upd`` joined as d, p and u (the rare answers as JSON: every column costs the client time).
ANSWER = """row_to_json(d)::text AS done, row_to_json(p)::text AS prior,
       u.sku IS NOT NULL AS applied, u.sku, u.on_hand, u.reserved, u.available, u.fence_token, u.quantity,
       u.now_ms"""


def variants(render: Callable[[dict[str, str]], str]) -> Variants:
    """The four variants (:data:`reservations.sql_text.Variants`) of the statement ``render`` makes of its
    parts: ``head``, ``tail``, ``answer``, ``accepted`` (the fence predicate, from fencing, or TRUE for
    lease-only) and ``now_ms``."""
    return sql_text.variants(
        lambda fenced, speaking: render(
            {
                "head": HEAD if speaking else HEAD_PLAIN,
                "tail": TAIL if speaking else TAIL_PLAIN,
                "answer": ANSWER,
                "accepted": sql_text.fence_admits(Fence(stock)) if fenced else "TRUE",
                "now_ms": sql_text.NOW_MS,
            }
        )
    )


@dataclass(frozen=True, slots=True)
class Written:
    """The write a statement is asked to make and record: what the TAIL's parameters say."""

    lease: Lease
    key: str
    operation: str
    fingerprint: str
    status: str  # the request's final status when it succeeds
    reservation_ids: tuple[str, ...] = ()
    detail: dict[str, Any] | None = None  # the outcome's detail; the history row's, as sorted JSON

    def values(self, speaker: Speaker | None) -> dict[str, Any]:
        detail = self.detail or {}
        return {
            "key": self.key,
            "operation": self.operation,
            "fingerprint": self.fingerprint,
            "status": self.status,
            "token": self.lease.token,
            "lease_id": self.lease.lease_id,
            "holder": self.lease.holder,
            "reservation_id": self.reservation_ids[0] if self.reservation_ids else None,
            "reservation_ids": json.dumps(list(self.reservation_ids)),
            "detail": json.dumps(detail),
            "history_detail": json.dumps(detail, sort_keys=True) if self.detail else None,
            "record": speaker is not None,
            "task_id": None if speaker is None else speaker.task_id,
            "worker": None if speaker is None else speaker.worker,
            "epochs": 0 if speaker is None else speaker.epochs,
        }

    def applied(self, row: Any, speaker: Speaker | None) -> Applied:
        """What the statement wrote, from the answer row of a statement whose ``upd`` wrote."""
        level = StockLevel(row.sku, row.on_hand, row.reserved, row.available, row.fence_token)
        outcome = Outcome(
            operation=self.operation,
            key=self.key,
            token=self.lease.token,
            reservation_ids=self.reservation_ids,
            stock=(level,),
            quantity=row.quantity,
            detail=self.detail or {},
        )
        if speaker is None:
            return Applied(outcome, None)
        summary = outcome.summary()
        told = speaker.told(self.key, self.operation, self.fingerprint, self.status, summary, row.now_ms)
        return Applied(outcome, told)


def exchange(
    written: Written,
    statements: Variants,
    values: dict[str, Any],
    refused: Callable[[Any], NoReturn],
    fence: Fence,
    speaker: Speaker | None,
) -> Plan[Ended | Replay | Applied]:
    """Send a step's statement (the variant for ``fence`` and ``speaker``) with the TAIL's parameters and
    the step's own ``values``, and read its one row: the request had ended, the key had a record, or the
    write was made. A statement that wrote nothing while the key still holds nothing was refused:
    ``refused`` raises the step's own refusal from its row."""
    statement = statements[(fence.enforce, speaker is not None)]
    found: Rows = yield Alone(statement.text, statement.bind({**written.values(speaker), **values}))
    row: Any = found.rows[0]
    head = read_head(row, written.key)
    if head is not None:
        return head
    if row.applied:
        return written.applied(row, speaker)
    # Refused: what the key says now (see ``_AGAIN``), or the step's refusal if it still has nothing.
    found = yield Alone(_AGAIN.text, _AGAIN.bind({"key": written.key, "record": speaker is not None}))
    again = read_head(found.rows[0], written.key)
    if again is None:
        refused(row)
    return again


# The key looked at again after the statement refused its write: a copy of the request (or another request
# under the key) may have committed while the statement waited on the row lock, after the snapshot HEAD
# read. The multi-statement plan reads the key after taking that lock, so it answers from what the copy
# stored; so does this, before any refusal is raised or recorded. Rare: one more round trip.
_AGAIN_SQL = """
SELECT (SELECT row_to_json(o)::text FROM ({done}) AS o) AS done,
       (SELECT row_to_json(p)::text FROM ({prior}) AS p) AS prior"""
_AGAIN = sql_text.sent(_AGAIN_SQL.format(**_READS))
