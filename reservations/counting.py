"""Writes decided from a read: a cycle count (on hand := the counted figure) and replenishment to par (order
``par - on hand``). Their holder reads the stock under its lease with :meth:`StockCounting.look`, which
raises the row's fence to the lease's token, so no older epoch can write between that read and the write
decided from it; each write records what it saw, so an auditor can tell a decision made from a stale view.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import partial

import sqlalchemy as sa

from fencing import FenceOutcome, Lease, StaleToken
from fencing.plan import Atomic, Bound, Plan
from fencing.sql import Rows
from reservations import keyed_statement as keyed
from reservations import stock_statement
from reservations import validation as valid
from reservations.errors import InvalidRequest, SeenInAnotherEpoch, UnknownSku
from reservations.keyed_steps import Step
from reservations.ledger import Ledger, Shell, fingerprint, one
from reservations.models import sku_checkpoints, sku_history, stock
from reservations.on_hand import change_on_hand
from reservations.reads import STOCK_COLUMNS, stock_level
from reservations.statuses import SUCCEEDED
from reservations.stock_statement import Change
from reservations.values import Outcome, StockLevel

# The operations whose size or figure is decided from a read; their history rows carry what was seen.
DECIDED = ("count", "replenish")


@dataclass(frozen=True, slots=True)
class StockSeen:
    """A SKU's stock as its holder read it before deciding a write, and its version: the id of the SKU's
    newest accepted write in the history (a later write has a larger id)."""

    sku: str
    on_hand: int
    reserved: int
    available: int
    fence_token: int
    version: int


# -- checks and decisions, before any I/O -------------------------------------------------------------


def counted_units(value: object) -> int:
    """A counted figure: zero (an empty shelf) up to :data:`~reservations.validation.MAX_ON_HAND`."""
    return valid.whole(value, "counted", 0, valid.MAX_ON_HAND)


def par_units(value: object) -> int:
    """A par level: the on-hand figure a replenishment orders up to."""
    return valid.whole(value, "par", 1, valid.MAX_ON_HAND)


def shrinkage_units(value: object) -> int | None:
    """Units a count finds missing from what its holder read (None: the count was sent as a figure)."""
    return None if value is None else valid.whole(value, "shrinkage", 0, valid.MAX_QUANTITY)


def seen_of(value: object, sku: str, lease: Lease) -> StockSeen:
    """What a write was decided from: a :class:`StockSeen` of the same SKU, read under the writing lease.

    A read under another token is refused (:class:`SeenInAnotherEpoch`): the fence stops an older lease
    from writing, but a current lease writing what an older read decided would overwrite, or order on top
    of, stock written since that read, and its history row would record a ``seen`` it never read."""
    if not isinstance(value, StockSeen):
        raise InvalidRequest(f"seen must be a StockSeen, not {type(value).__name__}", field="seen")
    if value.sku != sku:
        raise InvalidRequest(f"seen is the stock of {value.sku!r}, not of {sku!r}", field="seen")
    # look() leaves the row's fence at its lease's token, so a read under this lease carries that token.
    if value.fence_token != lease.token:
        raise SeenInAnotherEpoch(sku=sku, seen_token=value.fence_token, token=lease.token)
    return value


def short_count(seen: StockSeen, shrinkage: int) -> int:
    """The figure of a count that found ``shrinkage`` units fewer than were seen on hand; never below the
    units held, which the shelf still has to hold."""
    return max(seen.reserved, seen.on_hand - shrinkage)


def to_order(seen: StockSeen, par: int) -> int:
    """Units a replenishment orders: up to ``par`` from the on-hand figure seen, none above it."""
    return max(0, par - seen.on_hand)


def count_fingerprint(sku: str, counted: int | None, shrinkage: int | None) -> str:
    """A count is named by what was sent: its figure, or the shrinkage its figure is decided from at run
    time, so a redelivered count that reads another level replays the first one instead of conflicting."""
    if shrinkage is not None:
        return fingerprint("count", sku=sku, shrinkage=shrinkage)
    return fingerprint("count", sku=sku, counted=counted)


def replenish_fingerprint(sku: str, par: int) -> str:
    return fingerprint("replenish", sku=sku, par=par)


def _seen_detail(seen: StockSeen | None) -> dict[str, int]:
    return {} if seen is None else {"seen": seen.version, "seen_on_hand": seen.on_hand}


# Built once: the id of a SKU's newest accepted write (the history index is on (sku, id)); once all of
# the SKU's history was archived, the newest row id its checkpoint recorded: later writes' ids are higher,
# so a version never goes back.
_VERSION = sa.select(
    sa.func.coalesce(
        sa.select(sku_history.c.id)
        .where(sku_history.c.sku == sa.bindparam("sku"), sku_history.c.kind == "write")
        .order_by(sku_history.c.id.desc())
        .limit(1)
        .scalar_subquery(),
        sa.select(sa.func.max(sku_checkpoints.c.last_id))
        .where(sku_checkpoints.c.sku == sa.bindparam("sku"))
        .scalar_subquery(),
    )
)


def look(inventory: Shell, lease: Lease, sku: str) -> Plan[StockSeen]:
    """The SKU's stock and version, read under ``lease`` to decide a write from. The read raises the
    row's fence to the lease's token (a guarded UPDATE that changes no units), so a write of an older
    epoch cannot land between this read and the write decided from it: it is refused at the row. A
    newer epoch that wrote already makes the read itself stale: refused and recorded, like a write."""
    ledger = inventory.ledger
    valid.lease(lease)
    valid.sku(sku)
    try:
        seen: StockSeen = yield Atomic(_look(ledger, lease, sku))
    except StaleToken as stale:
        yield Atomic(one(ledger.rejection(stale, lease, sku, "look", None, None)))
        raise
    return seen


def _look(ledger: Ledger, lease: Lease, sku: str) -> Plan[StockSeen]:
    result = yield from ledger.fence.plan(
        lease,
        scope=valid.scope_of(sku),
        where=[stock.c.sku == sku],
        values={},
        returning=STOCK_COLUMNS,
        operation="look",
    )
    if result.outcome is FenceOutcome.NO_ROW:
        raise UnknownSku(sku)
    if result.outcome is not FenceOutcome.APPLIED:  # pragma: no cover - the read has no condition
        raise RuntimeError(f"the read of {sku!r} was neither applied nor refused")
    # Under the row lock the guarded UPDATE took: no write of this SKU can come between.
    found: Rows = yield Bound(_VERSION, {"sku": sku})
    version = found.first()
    newest = 0 if version is None or version[0] is None else int(version[0])
    return StockSeen(**asdict(StockLevel(*result.row)), version=newest)


def count_step(
    ledger: Ledger, lease: Lease, sku: str, counted: int, key: str, seen: StockSeen | None,
    shrinkage: int | None,
) -> Step:  # fmt: skip
    """A cycle count (:meth:`reservations.Inventory.count`), checked, both ways it can be sent."""
    valid.lease(lease)
    valid.sku(sku)
    counted_units(counted)
    valid.idempotency_key(key)
    shrinkage_units(shrinkage)
    # A figure decided from a read must say which read; a figure sent may come without one.
    checked = None if seen is None and shrinkage is None else seen_of(seen, sku, lease)
    detail: dict[str, int] = {"counted": counted, **_seen_detail(checked)}
    if shrinkage is not None:
        detail["shrinkage"] = shrinkage
    print_ = count_fingerprint(sku, counted, shrinkage)

    def apply() -> Plan[Outcome]:
        # The envelope locked the row: the level read here is the one the count replaces.
        before = yield from stock_level(sku)
        level = yield from ledger.fenced(lease, sku, "count", counted=counted)
        change = counted - before.on_hand
        yield ledger.history(
            lease, sku, "count", key, quantity=change, on_hand=change,
            detail=json.dumps(detail, sort_keys=True),
        )  # fmt: skip
        return Outcome(
            operation="count", key=key, token=lease.token, stock=(level,), quantity=change, detail=detail
        )

    rejection = partial(ledger.rejection, lease=lease, sku=sku, operation="count", key=key, quantity=counted)
    several = partial(ledger.idempotent, key, "count", print_, apply, rejection, ledger.lock_skus(sku))
    written = keyed.Written(lease, key, "count", print_, SUCCEEDED["count"], detail=detail)
    return stock_statement.step(ledger.fence, written, sku, Change.SET, counted, several, rejection)


def replenish_step(ledger: Ledger, lease: Lease, sku: str, par: int, key: str, seen: StockSeen) -> Step:
    """A replenishment to par (:meth:`reservations.Inventory.replenish`), checked, both ways it can be
    sent."""
    valid.lease(lease)
    valid.sku(sku)
    par_units(par)
    valid.idempotency_key(key)
    checked = seen_of(seen, sku, lease)
    order = to_order(checked, par)
    detail = {"par": par, **_seen_detail(checked)}

    print_ = replenish_fingerprint(sku, par)

    rejection = partial(
        ledger.rejection, lease=lease, sku=sku, operation="replenish", key=key, quantity=order
    )
    several = partial(change_on_hand, ledger, lease, sku, order, key, "replenish", print_, detail=detail)
    written = keyed.Written(lease, key, "replenish", print_, SUCCEEDED["replenish"], detail=detail)
    return stock_statement.step(ledger.fence, written, sku, Change.ADD, order, several, rejection)
