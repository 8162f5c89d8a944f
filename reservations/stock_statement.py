"""A stock-maintenance write on PostgreSQL as ONE statement (:mod:`reservations.keyed_statement`): a
restock or a replenishment (units added to on hand) and a cycle count (on hand set to the figure counted).
The same decisions as the multi-statement plans (:mod:`reservations.on_hand`, :mod:`reservations.counting`):
the fence sits in the stock UPDATE's WHERE with the write's own condition (room under
:data:`~reservations.validation.MAX_ON_HAND` for units added, no fewer than the units held for a count),
and a refusal writes nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from functools import partial
from typing import Any, NoReturn

import sqlalchemy as sa

from fencing import Fence, StaleToken
from fencing.plan import Plan
from reservations import keyed_statement as keyed
from reservations import validation as valid
from reservations.errors import CountBelowHeld, StockLimitExceeded, UnknownSku
from reservations.keyed_steps import Step
from reservations.sql_text import Variants
from reservations.values import Outcome

#   cur   the SKU's stock row, locked FOR UPDATE (under READ COMMITTED the newest version once a
#         concurrent writer commits), unless the key already has a record or the request has ended.
#         ``accepted`` is the fence; ``fits`` the write's own condition.
#   upd   the write, only when both hold.
_SQL = """
WITH {head}, cur AS (
    SELECT sku, on_hand, reserved, available, fence_token, fence_lease_id,
           {accepted} AS accepted, {fits} AS fits, {now_ms} AS now_ms
    FROM stock
    WHERE sku = %(sku)s::text AND NOT EXISTS (SELECT 1 FROM prior) AND NOT EXISTS (SELECT 1 FROM done)
    FOR UPDATE
), upd AS (
    UPDATE stock AS s
    SET on_hand = {on_hand}, available = {available},
        fence_token = %(token)s::bigint, fence_lease_id = %(lease_id)s::text, updated_ms = cur.now_ms
    FROM cur
    WHERE s.sku = cur.sku AND cur.accepted AND cur.fits
    RETURNING s.sku, s.on_hand, s.reserved, s.available, s.fence_token, cur.now_ms,
              s.on_hand - cur.on_hand AS quantity, s.on_hand - cur.on_hand AS on_hand_delta,
              0::bigint AS reserved_delta
), {tail}
SELECT {answer}, c.sku IS NOT NULL AS known, c.accepted, c.fits, c.on_hand AS seen_on_hand,
       c.reserved AS seen_reserved, c.fence_token AS highest, c.fence_lease_id AS writer
FROM (SELECT 1) AS one
LEFT JOIN done AS d ON TRUE
LEFT JOIN prior AS p ON TRUE
LEFT JOIN cur AS c ON TRUE
LEFT JOIN upd AS u ON TRUE
"""


class Change(enum.Enum):
    """How the write moves on hand: ``units`` added (restock, replenish), or on hand set to ``units``
    (count). Each renders its columns and its condition."""

    ADD = "add"
    SET = "set"


# Units added must leave on hand within MAX_ON_HAND: the bound (``ceiling``, computed by the caller so
# ``on_hand + units`` cannot overflow first) is None when no units come in. A count may not go below the
# units held.
_SHAPES = {
    Change.ADD: {
        "on_hand": "s.on_hand + %(units)s::bigint",
        "available": "s.available + %(units)s::bigint",
        "fits": "(%(ceiling)s::bigint IS NULL OR on_hand <= %(ceiling)s::bigint)",
    },
    Change.SET: {
        "on_hand": "%(units)s::bigint",
        "available": "%(units)s::bigint - s.reserved",
        "fits": "reserved <= %(units)s::bigint",
    },
}


def _variants(change: Change) -> Variants:
    return keyed.variants(lambda parts: _SQL.format(**parts, **_SHAPES[change]))


# The fence predicate and the database clock come from fencing (keyed.variants renders them).
STATEMENTS = {change: _variants(change) for change in Change}


def refusal(written: keyed.Written, sku: str, change: Change, units: int, fence: Fence, row: Any) -> NoReturn:
    """Raise what the statement's answer ``row`` refused the write for, having written nothing:
    :class:`UnknownSku`, :class:`StockLimitExceeded` (units added), :class:`CountBelowHeld` (a count) or
    :class:`~fencing.StaleToken` (``fence`` marks the lease lost)."""
    if not row.known:
        raise UnknownSku(sku)
    lease = written.lease
    # The statement judged the token by the fence's own predicate; the fence raises the error.
    fence.refuse_if_stale(lease, lease.scope, int(row.highest), row.writer, written.operation)
    if row.accepted and not row.fits:
        if change is Change.SET:
            raise CountBelowHeld(sku=sku, counted=units, held=int(row.seen_reserved))
        limit = valid.MAX_ON_HAND
        raise StockLimitExceeded(sku=sku, on_hand=int(row.seen_on_hand), delta=units, limit=limit)
    raise RuntimeError(f"the {written.operation} statement for {sku!r} neither wrote nor refused")


def step(
    fence: Fence,
    written: keyed.Written,
    sku: str,
    change: Change,
    units: int,
    several: Callable[[], Plan[Outcome]],
    rejection: Callable[[StaleToken], sa.Executable],
) -> Step:
    """The stock write of ``written`` as a :class:`~reservations.keyed_steps.Step`: ``several`` is its
    multi-statement plan, and this module's statement the one."""
    ceiling = valid.MAX_ON_HAND - units if change is Change.ADD and units > 0 else None
    values = {"sku": sku, "units": units, "ceiling": ceiling}
    refused = partial(refusal, written, sku, change, units, fence)
    send = partial(keyed.exchange, written, STATEMENTS[change], values, refused)
    return Step(written, valid.scope_of(sku), several, send, rejection)
