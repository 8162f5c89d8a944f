"""The ledger: what every fenced stock write is wrapped in, written once for all operations.

An operation runs in one transaction: idempotency lookup, the fenced UPDATE of the stock row, its other
rows, the history row and the idempotency record commit together or not at all. A stale token rolls
everything back and is then recorded in a transaction of its own, so the refusal is durable.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import sqlalchemy as sa

from fencing import Fence, FenceOutcome, Lease, StaleToken
from fencing.plan import Atomic, Plan
from fencing.sql import Rows, db_now_ms
from reservations import sql_text
from reservations import validation as valid
from reservations.collisions import KeptColliding, rounds
from reservations.errors import (
    CountBelowHeld,
    IdempotencyConflict,
    InsufficientStock,
    KeyTaken,
    RequestClosed,
    StockLimitExceeded,
    UnknownSku,
)
from reservations.models import idempotency_keys, reservations, sku_history, stock
from reservations.reads import STOCK_COLUMNS, stock_level
from reservations.statuses import RequestStatus
from reservations.values import Outcome, StockLevel

# The idempotency records have one writer: the plans insert them with :func:`records`, and the one-statement
# writes on PostgreSQL embed the INSERTs below, each from the rows of its CTEs.
_INTO = "INSERT INTO idempotency_keys (key, fingerprint, operation, outcome, token, created_ms)"
# Applied (reserve_statement, keyed_statement): from ``upd``, the stock row after the write and now_ms, the
# Outcome as Outcome.to_json names its fields.
_RECORDED = """{into}
    SELECT %(key)s::text, %(fingerprint)s::text, {operation},
           json_build_object(
               'operation', {operation}, 'key', %(key)s::text, 'token', %(token)s::bigint,
               'reservation_ids', {reservation_ids},
               'stock', json_build_array(json_build_object(
                   'sku', sku, 'on_hand', on_hand, 'reserved', reserved, 'available', available,
                   'fence_token', fence_token)),
               'quantity', {quantity}, 'detail', {detail})::text,
           %(token)s::bigint, now_ms
    FROM upd"""
# A reservation short of units (reserve_statement): from ``cur``, the row it locked.
_SHORT = """{into}
    SELECT %(key)s::text, %(fingerprint)s::text, 'reserve',
           json_build_object('error', 'insufficient_stock', 'sku', sku,
                             'requested', %(quantity)s::bigint, 'available', available)::text,
           NULL, now_ms
    FROM cur
    WHERE cur.accepted AND NOT cur.enough"""
# A batch's records (batch_statement), as the batch decided them (:func:`records`' rows, as JSON).
_BATCHED = """{into}
    SELECT r.key, r.fingerprint, r.operation, r.outcome, r.token, c.now_ms
    FROM json_to_recordset(%(records)s::json)
         AS r(key text, fingerprint text, operation text, outcome text, token bigint),
         clock AS c, ok
    WHERE ok.ok"""


def recorded(**known: str) -> str:
    """The record of an applied write, ``known``: the operation, reservation ids, quantity and detail as
    the statement knows them in SQL."""
    return _RECORDED.format(into=_INTO, **known)


SHORT = _SHORT.format(into=_INTO)
BATCHED = _BATCHED.format(into=_INTO)


# The key's record, as a statement reads it first.
PRIOR = "SELECT fingerprint, operation, outcome FROM idempotency_keys WHERE key = %(key)s::text"

# A key closed without effect (a request that ended invalid, dead-lettered or expired) keeps this record,
# so a copy of its request still in flight replays "closed" instead of applying late.
TOMBSTONE_FINGERPRINT = "closed"


def records(*rows: dict[str, Any]) -> sa.Insert:
    """Insert the records ``rows`` (key, fingerprint, operation, outcome, token), at the database's time."""
    return sql_text.stamped(idempotency_keys, "created_ms", rows)


def record(key: str, print_: str, operation: str, outcome: str, token: int | None = None) -> dict[str, Any]:
    return {"key": key, "fingerprint": print_, "operation": operation, "outcome": outcome, "token": token}


def closed(key: str, operation: str, status: str) -> dict[str, Any]:
    """The tombstone of a key closed in ``status``."""
    return record(key, TOMBSTONE_FINGERPRINT, operation, json.dumps({"error": "closed", "status": status}))


def short(key: str, print_: str, operation: str, error: InsufficientStock) -> dict[str, Any]:
    """The record of a request refused for lack of units: replayed as the same refusal."""
    refusal = json.dumps({"error": RequestStatus.INSUFFICIENT_STOCK, **error.summary()})
    return record(key, print_, operation, refusal)


def one(stmt: sa.Executable) -> Plan[None]:
    """A plan of one statement."""
    yield stmt


def fingerprint(operation: str, **request: Any) -> str:
    """Identifies a request independent of its key: same key + different fingerprint is a conflict."""
    canonical = json.dumps({"operation": operation, **request}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def hold_ms_of(hold_for: float | None) -> int | None:
    """A validated hold in whole milliseconds (at least 1), or None for a hold without expiry."""
    hold = valid.hold_seconds(hold_for)
    return None if hold is None else max(1, round(hold * 1000))


def new_reservation_id() -> str:
    return f"r_{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class HeldLine:
    """One reservation of a batch held together (:func:`reservations.batch_statement.write`)."""

    key: str
    quantity: int
    hold_ms: int | None
    reservation_id: str


class _Refused(Exception):
    """Carries a business refusal out of a rolled-back transaction so it can be stored on its own."""

    def __init__(self, error: InsufficientStock) -> None:
        self.error = error


def reservation_conflict(key: str, operation: str) -> IdempotencyConflict:
    # The key's record was purged, but the reservation it created is still there.
    return IdempotencyConflict(
        key=key, operation=operation, stored_operation="a reservation whose record expired"
    )


class Shell(Protocol):
    """An inventory shell as the plans it runs as its own operations see it (they take it first, as the
    method's ``self``): the holder of the ledger. Every other plan takes the ledger itself."""

    ledger: Ledger


class Ledger:
    """The envelope of every fenced write: idempotency, row locks, the fenced stock change, history
    rows and the durable record of a refused stale token. Decisions and statements only; no I/O."""

    def __init__(
        self,
        *,
        enforce_fence: bool = True,
        before_statement: Callable[[Lease], None] | None = None,
        single_statement: bool = False,
    ) -> None:
        self.fence = Fence(stock, enforce=enforce_fence, before_statement=before_statement)
        # PostgreSQL: a single-SKU reservation is one statement (reservations.reserve_statement), and so
        # is each later step (reservations.keyed_steps).
        self.single_statement = single_statement

    # -- the idempotent envelope -------------------------------------------------------------------

    def idempotent(
        self,
        key: str,
        operation: str,
        print_: str,
        apply: Callable[[], Plan[Outcome]],
        on_stale: Callable[[StaleToken], sa.Executable],
        lock: Callable[[], Plan[None]],
    ) -> Plan[Outcome]:

        def replayable(taken: KeyTaken) -> None:
            """Return when a concurrent attempt with the same key committed first (the next round replays
            its record or outcome); raise anything else."""
            if taken.where == "reservation":
                # Attempts on one SKU queue on its stock row and read the key after locking it, so on this
                # path the clash is not a race.
                raise reservation_conflict(key, operation) from None
            if taken.where not in ("record", "outcome"):
                raise taken

        try:
            for round_ in rounds(on_taken=replayable):
                with round_:
                    try:
                        outcome: Outcome = yield Atomic(self._attempt(key, operation, print_, apply, lock))
                        return outcome
                    except _Refused as refused:
                        # A concurrent attempt that stored its outcome first fails this store on the key:
                        # the next round replays it.
                        stored: Outcome | None = yield Atomic(
                            self._store_refusal(key, operation, print_, refused.error)
                        )
                        if stored is not None:
                            return stored  # a concurrent attempt applied the key meanwhile: it stands
                        raise refused.error from None
        except StaleToken as stale:
            yield Atomic(one(on_stale(stale)))
            raise
        raise KeptColliding(f"idempotency key {key!r}")

    def _attempt(
        self,
        key: str,
        operation: str,
        print_: str,
        apply: Callable[[], Plan[Outcome]],
        lock: Callable[[], Plan[None]],
    ) -> Plan[Outcome]:
        # Stock rows first, then everything else: two attempts on the same SKU (a redelivery racing a
        # retry, two epochs) queue here, and the second sees what the first committed.
        yield from lock()
        found: Rows = yield sa.select(idempotency_keys).where(idempotency_keys.c.key == key)
        stored = found.first()
        if stored is not None:
            return self.replay(stored, operation, print_)
        try:
            outcome = yield from apply()
        except InsufficientStock as error:
            raise _Refused(error) from None
        yield records(record(key, print_, operation, outcome.to_json(), outcome.token))
        return outcome

    def lock_skus(self, *skus: str) -> Callable[[], Plan[None]]:
        """Lock the stock rows in sorted order (PostgreSQL; SQLite transactions are already exclusive)."""

        def lock() -> Plan[None]:
            for sku in sorted(set(skus)):
                yield sa.select(stock.c.sku).where(stock.c.sku == sku).with_for_update()

        return lock

    def lock_reservation_sku(self, reservation_id: str) -> Callable[[], Plan[None]]:
        def lock() -> Plan[None]:
            # A reservation's SKU never changes (a trigger refuses it), so it is safe to read unlocked.
            found: Rows = yield sa.select(reservations.c.sku).where(reservations.c.id == reservation_id)
            row = found.first()
            if row is not None:
                yield from self.lock_skus(row.sku)()

        return lock

    def replay(self, stored: Any, operation: str, print_: str) -> Outcome:
        if stored.fingerprint == TOMBSTONE_FINGERPRINT:
            raise RequestClosed(key=stored.key, status=json.loads(stored.outcome).get("status", "closed"))
        if stored.fingerprint != print_:
            raise IdempotencyConflict(key=stored.key, operation=operation, stored_operation=stored.operation)
        data = json.loads(stored.outcome)
        if "error" in data:
            error = InsufficientStock(
                sku=data["sku"], requested=data["requested"], available=data["available"]
            )
            error.replayed = True
            raise error
        return Outcome.from_json(stored.outcome, replayed=True)

    def _store_refusal(
        self, key: str, operation: str, print_: str, error: InsufficientStock
    ) -> Plan[Outcome | None]:
        """Store a refusal as the key's outcome, unless an outcome arrived meanwhile: then replay that."""
        found: Rows = yield sa.select(idempotency_keys).where(idempotency_keys.c.key == key)
        stored = found.first()
        if stored is not None:
            return self.replay(stored, operation, print_)
        yield records(short(key, print_, operation, error))
        return None

    def rejection(
        self,
        stale: StaleToken,
        lease: Lease,
        sku: str,
        operation: str,
        key: str | None,
        quantity: int | None,
        reservation_id: str | None = None,
    ) -> sa.Executable:
        """The history row of a write refused for ``stale``: the token presented and the fence's."""
        return self.history(
            lease, sku, operation, key, quantity=quantity,
            reservation_id=reservation_id, kind="rejected", token=stale.presented,
            highest_token=stale.highest, detail=str(stale),
        )  # fmt: skip

    # -- building blocks ---------------------------------------------------------------------------

    def fenced(
        self,
        lease: Lease,
        sku: str,
        operation: str,
        *,
        on_hand: int = 0,
        reserved: int = 0,
        condition: sa.ColumnElement[bool] | None = None,
        counted: int | None = None,
    ) -> Plan[StockLevel]:
        """The fenced stock change; UnknownSku if there is no row, None-safe condition check.

        Units coming in must keep ``on_hand`` within MAX_ON_HAND; the bound is part of the UPDATE's own
        condition, so two restocks racing each other cannot both pass it. ``counted`` (a cycle count) sets
        on hand to that figure instead, refused with CountBelowHeld below the units held.
        """
        values: dict[str, Any] = {
            "on_hand": stock.c.on_hand + on_hand,
            "reserved": stock.c.reserved + reserved,
            "available": stock.c.available + (on_hand - reserved),
            "updated_ms": db_now_ms(),
        }
        if counted is not None:
            values.update(on_hand=counted, available=sa.literal(counted, sa.BigInteger) - stock.c.reserved)
            condition = stock.c.reserved <= counted
        elif on_hand > 0:
            # Compared against a bound computed here: ``on_hand + delta`` could overflow in SQL first.
            within = stock.c.on_hand <= valid.MAX_ON_HAND - on_hand
            condition = within if condition is None else sa.and_(condition, within)
        result = yield from self.fence.plan(
            lease,
            scope=valid.scope_of(sku),
            where=[stock.c.sku == sku],
            values=values,
            condition=condition,
            returning=STOCK_COLUMNS,
            operation=operation,
        )
        if result.outcome is FenceOutcome.NO_ROW:
            raise UnknownSku(sku)
        if result.outcome is FenceOutcome.CONDITION_FAILED:
            level = yield from stock_level(sku)
            if counted is not None:
                raise CountBelowHeld(sku=sku, counted=counted, held=level.reserved)
            if on_hand > 0 and level.on_hand > valid.MAX_ON_HAND - on_hand:
                limit = valid.MAX_ON_HAND
                raise StockLimitExceeded(sku=sku, on_hand=level.on_hand, delta=on_hand, limit=limit)
            raise InsufficientStock(sku=sku, requested=max(reserved, -on_hand), available=level.available)
        return StockLevel(*result.row)

    @staticmethod
    def history(
        lease: Lease,
        sku: str,
        operation: str,
        key: str | None,
        *,
        quantity: int | None,
        on_hand: int = 0,
        reserved: int = 0,
        reservation_id: str | None = None,
        detail: str | None = None,
        kind: str = "write",
        token: int | None = None,  # the lease's
        highest_token: int | None = None,
    ) -> sa.Executable:
        return sa.insert(sku_history).values(
            sku=sku, at_ms=db_now_ms(), kind=kind, operation=operation,
            token=lease.token if token is None else token, lease_id=lease.lease_id, holder=lease.holder,
            quantity=quantity, idempotency_key=key, reservation_id=reservation_id, on_hand_delta=on_hand,
            reserved_delta=reserved, highest_token=highest_token, detail=detail,
        )  # fmt: skip

    def unkeyed(
        self,
        apply: Callable[[], Plan[Outcome]],
        on_stale: Callable[[StaleToken], sa.Executable],
        lock: Callable[[], Plan[None]],
    ) -> Plan[Outcome]:
        def locked() -> Plan[Outcome]:
            yield from lock()
            return (yield from apply())

        try:
            outcome: Outcome = yield Atomic(locked())
            return outcome
        except StaleToken as stale:
            yield Atomic(one(on_stale(stale)))
            raise
