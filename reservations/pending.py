"""A hot SKU's pending list: a reservation that finds the SKU's lease busy hands itself to the list
(idempotent by key, one statement on PostgreSQL), and the lease's holder, the SKU's watch and the beat
sweep ask what is waiting. Serving the list is :mod:`reservations.batching`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

import sqlalchemy as sa

from fencing.plan import Alone, Atomic, Plan
from fencing.sql import Rows, db_now_ms
from reservations import sql_text
from reservations import validation as valid
from reservations.collisions import KeptColliding, rounds
from reservations.ledger import Shell, hold_ms_of
from reservations.models import pending_reservations, request_outcomes
from reservations.request_outcomes import result_from_json, result_of
from reservations.reserve_statement import Ended as Ended  # a hand-off's answer too


@dataclass(frozen=True, slots=True)
class Queued:
    """The request waits on its SKU's list (now, or already: a redelivery is not queued twice).
    ``first``: nothing waited before it, so its sender arranges a later look at the SKU's list."""

    first: bool


@dataclass(frozen=True, slots=True)
class Conflicting:
    """Its key is already queued for a different request: nothing was queued."""


# What queueing a request found: exactly one of these (Ended: it already had its final outcome, and
# nothing was queued).
HandOff: TypeAlias = Ended | Queued | Conflicting


# PostgreSQL: the hand-off as one statement, the decisions of ``_hand_off`` in one round trip with no
# transaction left open. ``done`` answers a request that already ended; ``mine`` is the key's place in
# the queue if it has one; ``added`` queues it when it has neither. The final row also says whether
# anything waited on the SKU before (the statement's snapshot does not see its own insert) and whether
# the queued key is this very request. Two copies racing on one key: the loser fails on the unique key,
# writes nothing, and looks again.
_HAND_OFF_SQL = """
WITH done AS (
    SELECT key, operation, status, detail, task_id, worker, epochs, at_ms, fingerprint
    FROM request_outcomes WHERE key = %(key)s::text
), mine AS (
    SELECT sku, quantity, hold_ms FROM pending_reservations WHERE key = %(key)s::text
), added AS (
    INSERT INTO pending_reservations (key, sku, quantity, hold_ms, task_id, epochs, enqueued_ms)
    SELECT %(key)s::text, %(sku)s::text, %(quantity)s::bigint, %(hold_ms)s::bigint,
           %(task_id)s::text, %(epochs)s::integer,
           {now_ms}
    WHERE NOT EXISTS (SELECT 1 FROM done) AND NOT EXISTS (SELECT 1 FROM mine)
    RETURNING id
)
SELECT (SELECT row_to_json(done) FROM done)::text AS done,
       EXISTS (SELECT 1 FROM pending_reservations WHERE sku = %(sku)s::text) AS any_waiting,
       EXISTS (SELECT 1 FROM mine) AS already,
       EXISTS (SELECT 1 FROM mine WHERE sku = %(sku)s::text AND quantity = %(quantity)s::bigint
               AND hold_ms IS NOT DISTINCT FROM %(hold_ms)s::bigint) AS same
"""
_HAND_OFF = _HAND_OFF_SQL.format(now_ms=sql_text.NOW_MS)  # the database clock, from fencing


def hand_off(
    inventory: Shell,
    sku: str,
    quantity: int,
    *,
    key: str,
    hold_for: float | None = None,
    task_id: str | None = None,
    epochs: int = 0,
) -> Plan[HandOff]:
    """Queue a reservation for the SKU's lease holder (or find the outcome it already has).

    A copy of a request already on the list (a redelivery) is not added twice: the key names one request.
    """
    valid.task_and_worker(task_id)
    valid.epochs(epochs)
    values = {
        "key": valid.idempotency_key(key),
        "sku": valid.sku(sku),
        "quantity": valid.quantity(quantity),
        "hold_ms": hold_ms_of(hold_for),
        "task_id": task_id,
        "epochs": epochs,
    }

    # The same key added concurrently fails on the unique key: the next round finds it queued.
    for round_ in rounds():
        with round_:
            if inventory.ledger.single_statement:
                found: Rows = yield Alone(_HAND_OFF, values)
                return _handed_off(found.rows[0])
            queued: HandOff = yield Atomic(_hand_off(values))
            return queued
    raise KeptColliding(f"the hand-off of {key!r}")


def _handed_off(row: Any) -> HandOff:
    if row.done is not None:
        return Ended(result_from_json(row.done))
    if row.already and not row.same:
        return Conflicting()
    return Queued(first=not row.any_waiting)


def _hand_off(values: dict[str, Any]) -> Plan[HandOff]:
    found: Rows = yield sa.select(request_outcomes).where(request_outcomes.c.key == values["key"])
    row = found.first()
    if row is not None:
        return Ended(result_of(row))
    # One round trip for all three: is anything waiting on the SKU, is this key already among it, and is
    # it queued as this very request (a redelivery) rather than a different one under the same key?
    pending = pending_reservations.c
    waiting: Rows = yield sa.select(
        sa.exists().where(pending.sku == values["sku"]),
        sa.exists().where(pending.key == values["key"]),
        sa.exists().where(
            pending.key == values["key"],
            pending.sku == values["sku"],
            pending.quantity == values["quantity"],
            sa.func.coalesce(pending.hold_ms, -1) == (-1 if values["hold_ms"] is None else values["hold_ms"]),
        ),
    )
    any_waiting, already, same = waiting.rows[0]
    if already and not same:
        return Conflicting()
    if not already:
        yield sa.insert(pending_reservations).values(enqueued_ms=db_now_ms(), **values)
    return Queued(first=not any_waiting)


# Built once: every reservation task asks this after releasing its lease.
_ANY_PENDING = (
    sa.select(pending_reservations.c.id).where(pending_reservations.c.sku == sa.bindparam("sku")).limit(1)
)


def has_pending(sku: str) -> Plan[bool]:
    found: Rows = yield Alone(_ANY_PENDING, {"sku": valid.sku(sku)})
    return found.first() is not None


def pending_count(sku: str | None = None) -> Plan[int]:
    query = sa.select(sa.func.count()).select_from(pending_reservations)
    if sku is not None:
        query = query.where(pending_reservations.c.sku == valid.sku(sku))
    found: Rows = yield query
    return int(found.rows[0][0])


def waiting_by_sku() -> Plan[dict[str, int]]:
    """How many requests wait for each SKU's lease holder (SKUs with none are left out)."""
    found: Rows = yield (
        sa.select(pending_reservations.c.sku, sa.func.count())
        .group_by(pending_reservations.c.sku)
        .order_by(pending_reservations.c.sku)
    )
    return {r[0]: int(r[1]) for r in found.rows}


def skus_waiting(*, older_than: float) -> Plan[list[str]]:
    """SKUs with a request waiting longer than ``older_than`` seconds (database clock), oldest first."""
    valid.number(older_than, "older_than", 0, 86400)
    oldest = sa.func.min(pending_reservations.c.enqueued_ms)
    found: Rows = yield (
        sa.select(pending_reservations.c.sku)
        .group_by(pending_reservations.c.sku)
        .having(oldest <= db_now_ms() - round(older_than * 1000))
        .order_by(oldest)
        .limit(1000)
    )
    return [r[0] for r in found.rows]


def drop_ended() -> Plan[int]:
    """Remove queued requests that ended elsewhere (a copy of the request was dead-lettered) and whose SKU saw
    no batch since: the next batch would remove them too, but a SKU may never get another request."""
    ended = sa.select(request_outcomes.c.key).where(request_outcomes.c.key == pending_reservations.c.key)
    gone: Rows = yield (
        sa.delete(pending_reservations).where(sa.exists(ended)).returning(pending_reservations.c.key)
    )
    return len(gone.rows)
