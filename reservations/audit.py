"""The audit: the inventory's invariants checked from the database alone, as structured violations (rule,
SKU, message) that the CLI, the tests, the demo and the chaos checker all read the same way.

Where each rule is also enforced (a CHECK constraint, a trigger, the fence) is listed in
docs/architecture.md, "Where each rule lives".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum

import sqlalchemy as sa

from fencing.plan import Plan
from fencing.sql import Rows, one_snapshot
from reservations.models import HELD, reservations, sku_history
from reservations.reads import NEWEST_CHECKPOINTS, STOCK_COLUMNS

# The operations whose key may write at most once; a confirm or release key writes once per reservation
# it finishes, so duplicates there are judged by whoever knows the requests (the chaos checker).
ONCE_PER_KEY = ("reserve", "reserve_many", "restock", "adjust", "count", "replenish")


class Rule(StrEnum):
    """The invariant a violation breaks."""

    OVERSELL = "oversell"  # available < 0: more units promised than the shelf holds
    CONSERVATION = "conservation"  # on_hand, reserved, held reservations and history disagree
    TOKEN_ORDER = "token_order"  # a write accepted with a token lower than an earlier accepted write
    KEY_APPLIED_TWICE = "key_applied_twice"  # one idempotency key changed stock more than once
    PAST_PAR = "past_par"  # a replenishment's order took on hand past its par (decided from a stale read)


@dataclass(frozen=True, slots=True)
class Violation:
    rule: Rule
    sku: str
    message: str

    def __str__(self) -> str:
        return f"{self.sku}: {self.message}"


def keys_written_twice(operations: sa.ColumnElement[bool]) -> sa.Select[str, str, str, int]:
    """(key, SKU, operation, writes) of every key that wrote more than once by the ``operations`` chosen."""
    return (
        sa.select(sku_history.c.idempotency_key, sku_history.c.sku, sku_history.c.operation, sa.func.count())
        .where(sku_history.c.kind == "write", sku_history.c.idempotency_key.is_not(None), operations)
        .group_by(sku_history.c.idempotency_key, sku_history.c.sku, sku_history.c.operation)
        .having(sa.func.count() > 1)
    )


def _past_par(key: str | None, detail: str | None, before: int, ordered: int) -> str | None:
    """Why a replenishment's order took on hand past its par, or None. Its history row records the par
    and the on hand it saw (reservations.counting); ``before`` is what was on hand when it was written.
    Ordering up to par from what was seen passes par only when on hand had grown since the read."""
    recorded = json.loads(detail) if detail else {}
    par = recorded.get("par")
    if ordered <= 0 or not isinstance(par, int) or before + ordered <= par:
        return None
    return (
        f"replenish {key!r} ordered {ordered} for par {par} having seen {recorded.get('seen_on_hand')}"
        f" on hand, leaving {before + ordered}"
    )


def invariant_violations() -> Plan[list[Violation]]:
    """Every broken invariant; an empty list means the inventory is consistent.

    Checks, per SKU: available >= 0; on_hand = available + reserved; reserved = units of held
    reservations; the history's deltas explain on_hand and reserved exactly (from the SKU's newest
    checkpoint, where history was archived); accepted writes never carry a token lower than an earlier
    accepted write (nor than the checkpoint's highest); each idempotency key created one reservation;
    no replenishment ordered on hand past its par.
    """
    # Read as of one moment: an audit of a live inventory must not see a write in its history that its
    # read of the stock (taken a statement earlier) did not.
    yield one_snapshot()
    levels: Rows = yield sa.select(*STOCK_COLUMNS)
    held: Rows = yield (
        sa.select(reservations.c.sku, sa.func.sum(reservations.c.quantity))
        .where(reservations.c.status == HELD)
        .group_by(reservations.c.sku)
    )
    # History archived whole (reservations.archive) left each SKU's sums in its newest checkpoint, written
    # in the transaction that took the rows out: checkpoint + the rows still here explain the stock.
    checkpoints: Rows = yield NEWEST_CHECKPOINTS
    is_replenish = sku_history.c.operation == "replenish"
    writes: Rows = yield (
        sa.select(
            sku_history.c.sku,
            sku_history.c.token,
            sku_history.c.id,
            sku_history.c.operation,
            sku_history.c.on_hand_delta,
            sku_history.c.reserved_delta,
            sku_history.c.idempotency_key,
            sa.case((is_replenish, sku_history.c.detail)),  # what the replenishment saw, its par
        )
        .where(sku_history.c.kind == "write")
        .order_by(sku_history.c.sku, sku_history.c.id)
    )
    # per SKU, replayed from the checkpoint on: (on hand, reserved) and the highest token accepted
    explained = {r.sku: (int(r.on_hand), int(r.reserved)) for r in checkpoints.rows}
    highest = {r.sku: int(r.highest_token) for r in checkpoints.rows}
    in_history: list[Violation] = []
    for sku, token, entry, operation, delta, reserved_delta, key, detail in writes.rows:
        if operation != "create":
            if token < highest.get(sku, 0):
                message = f"write #{entry} accepted with token {token} after token {highest[sku]}"
                in_history.append(Violation(Rule.TOKEN_ORDER, sku, message))
            highest[sku] = max(token, highest.get(sku, 0))
        before, reserved = explained.get(sku, (0, 0))
        explained[sku] = (before + delta, reserved + reserved_delta)
        past = _past_par(key, detail, before, delta) if operation == "replenish" else None
        if past is not None:
            in_history.append(Violation(Rule.PAST_PAR, sku, past))
    found: list[Violation] = []
    held_by_sku = {r[0]: int(r[1]) for r in held.rows}
    for r in levels.rows:
        if r.available < 0:
            found.append(Violation(Rule.OVERSELL, r.sku, f"available is negative ({r.available})"))
        if r.on_hand != r.available + r.reserved:
            message = f"on_hand {r.on_hand} != available {r.available} + reserved {r.reserved}"
            found.append(Violation(Rule.CONSERVATION, r.sku, message))
        if r.reserved != held_by_sku.get(r.sku, 0):
            message = f"reserved {r.reserved} != held reservations {held_by_sku.get(r.sku, 0)}"
            found.append(Violation(Rule.CONSERVATION, r.sku, message))
        if explained.get(r.sku, (0, 0)) != (r.on_hand, r.reserved):
            message = f"history explains {explained.get(r.sku)} not ({r.on_hand}, {r.reserved})"
            found.append(Violation(Rule.CONSERVATION, r.sku, message))
    found += in_history
    dupes: Rows = yield keys_written_twice(sku_history.c.operation.in_(ONCE_PER_KEY))
    found.extend(
        Violation(Rule.KEY_APPLIED_TWICE, r[1], f"key {r[0]!r} applied {r[3]} times by {r[2]}")
        for r in dupes.rows
    )
    return found
