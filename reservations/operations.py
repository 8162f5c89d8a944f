"""Fenced stock operations as plans: the one core behind :class:`Inventory` and :class:`AsyncInventory`.

Each operation runs in one transaction: idempotency lookup, the fenced UPDATE of the stock row, the
reservation change, the history row and the idempotency record commit together or not at all. A stale
token rolls everything back and is then recorded in a transaction of its own, so the refusal is durable.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from fencing import Fence, FenceOutcome, Lease, StaleToken
from fencing.plan import Alone, Atomic, Plan
from fencing.sql import Rows, db_now_ms
from reservations import reserve_statement
from reservations import validation as valid
from reservations.errors import (
    IdempotencyConflict,
    InsufficientStock,
    InvalidRequest,
    InvalidTransition,
    RequestClosed,
    ReservationError,
    StockLimitExceeded,
    UnknownReservation,
    UnknownSku,
)
from reservations.models import (
    CONFIRMED,
    EXPIRED,
    HELD,
    RELEASED,
    idempotency_keys,
    reservations,
    sku_history,
    stock,
)
from reservations.reads import STOCK_COLUMNS, stock_level
from reservations.requests import (
    TOMBSTONE_FINGERPRINT,
    RequestReply,
    RequestResult,
    record_attempt,
    record_outcome,
    request_outcome,
)
from reservations.statuses import AttemptResult, RequestStatus
from reservations.views import Outcome, StockLevel


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
    """One reservation of a batch held together (:meth:`InventoryPlans.hold_together`)."""

    key: str
    quantity: int
    hold_ms: int | None
    reservation_id: str


class _Refused(Exception):
    """Carries a business refusal out of a rolled-back transaction so it can be stored on its own."""

    def __init__(self, error: ReservationError) -> None:
        self.error = error


def _stored_error(data: dict[str, Any]) -> ReservationError:
    error = InsufficientStock(sku=data["sku"], requested=data["requested"], available=data["available"])
    error.replayed = True
    return error


def _key_taken(exc: IntegrityError) -> str | None:
    """Which of a request's keys a unique violation is about: "reservation" (a reservation already has
    the key), "record" (its idempotency record or final outcome exists), or None for anything else."""
    diag = getattr(exc.orig, "diag", None)
    name = str(getattr(diag, "constraint_name", None) or exc.orig)  # SQLite only has the message
    if "reservations" in name and "idempotency_key" in name:
        return "reservation"
    if "idempotency_key" in name or "request_outcomes" in name:
        return "record"
    return None


def _reservation_conflict(key: str, operation: str) -> IdempotencyConflict:
    # The key's record was purged, but the reservation it created is still there.
    return IdempotencyConflict(
        key=key, operation=operation, stored_operation="a reservation whose record expired"
    )


def _raise_unless_key_taken(exc: IntegrityError, key: str, operation: str) -> None:
    """Return when ``exc`` is a concurrent attempt with the same key having committed first (the next
    round replays it); raise anything else."""
    taken = _key_taken(exc)
    if taken == "reservation":
        # Attempts on one SKU queue on its stock row and read the key after locking it, so on this
        # path the clash is not a race.
        raise _reservation_conflict(key, operation) from None
    if taken is None:
        raise exc


def _checked_reserve(
    lease: Lease, sku: str, quantity: int, key: str, hold_for: float | None
) -> tuple[int | None, str]:
    """A single-SKU reservation's arguments checked before any I/O: its hold in milliseconds and its
    fingerprint."""
    valid.lease(lease)
    valid.sku(sku)
    valid.quantity(quantity)
    valid.idempotency_key(key)
    hold_ms = hold_ms_of(hold_for)
    return hold_ms, fingerprint("reserve", sku=sku, quantity=quantity, hold_ms=hold_ms)


# Built once: a key's idempotency record, for the rare lookups outside the reservation statement.
_RECORD = sa.select(
    idempotency_keys.c.key,
    idempotency_keys.c.fingerprint,
    idempotency_keys.c.operation,
    idempotency_keys.c.outcome,
).where(idempotency_keys.c.key == sa.bindparam("key"))


class InventoryPlans:
    """Decisions and statements for every inventory operation; no I/O."""

    def __init__(
        self,
        *,
        enforce_fence: bool = True,
        before_statement: Callable[[Lease], None] | None = None,
        single_statement: bool = False,
    ) -> None:
        self.fence = Fence(stock, enforce=enforce_fence, before_statement=before_statement)
        # PostgreSQL: a single-SKU reservation is one statement (reservations.reserve_statement).
        self.single_statement = single_statement

    # -- the idempotent envelope -------------------------------------------------------------------

    def _idempotent(
        self,
        key: str,
        operation: str,
        print_: str,
        apply: Callable[[], Plan[Outcome]],
        on_stale: Callable[[StaleToken], sa.Executable],
        lock: Callable[[], Plan[None]],
    ) -> Plan[Outcome]:
        for _ in range(3):
            try:
                outcome: Outcome = yield Atomic(self._attempt(key, operation, print_, apply, lock))
                return outcome
            except _Refused as refused:
                try:
                    stored: Outcome | None = yield Atomic(
                        self._store_refusal(key, operation, print_, refused.error)
                    )
                except IntegrityError:
                    continue  # a concurrent attempt stored its outcome first: the next round replays it
                if stored is not None:
                    return stored  # a concurrent attempt applied the key meanwhile: its outcome stands
                raise refused.error from None
            except StaleToken as stale:
                yield Atomic(self.one(on_stale(stale)))
                raise
            except IntegrityError as exc:
                _raise_unless_key_taken(exc, key, operation)
                # A concurrent attempt with the same key committed first; the next round replays it.
        raise RuntimeError(f"idempotency key {key!r} kept colliding")  # pragma: no cover

    def one(self, stmt: sa.Executable) -> Plan[None]:
        yield stmt

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
        yield sa.insert(idempotency_keys).values(
            key=key,
            fingerprint=print_,
            operation=operation,
            outcome=outcome.to_json(),
            token=outcome.token,
            created_ms=db_now_ms(),
        )
        return outcome

    def _lock_skus(self, *skus: str) -> Callable[[], Plan[None]]:
        """Lock the stock rows in sorted order (PostgreSQL; SQLite transactions are already exclusive)."""

        def lock() -> Plan[None]:
            for sku in sorted(set(skus)):
                yield sa.select(stock.c.sku).where(stock.c.sku == sku).with_for_update()

        return lock

    def _lock_reservation_sku(self, reservation_id: str) -> Callable[[], Plan[None]]:
        def lock() -> Plan[None]:
            # A reservation's SKU never changes (a trigger refuses it), so it is safe to read unlocked.
            found: Rows = yield sa.select(reservations.c.sku).where(reservations.c.id == reservation_id)
            row = found.first()
            if row is not None:
                yield from self._lock_skus(row.sku)()

        return lock

    def replay(self, stored: Any, operation: str, print_: str) -> Outcome:
        if stored.fingerprint == TOMBSTONE_FINGERPRINT:
            raise RequestClosed(key=stored.key, status=json.loads(stored.outcome).get("status", "closed"))
        if stored.fingerprint != print_:
            raise IdempotencyConflict(key=stored.key, operation=operation, stored_operation=stored.operation)
        data = json.loads(stored.outcome)
        if "error" in data:
            raise _stored_error(data)
        return Outcome.from_json(stored.outcome, replayed=True)

    def _store_refusal(
        self, key: str, operation: str, print_: str, error: ReservationError
    ) -> Plan[Outcome | None]:
        """Store a refusal as the key's outcome, unless an outcome arrived meanwhile: then replay that."""
        assert isinstance(error, InsufficientStock)
        outcome = json.dumps(
            {
                "error": RequestStatus.INSUFFICIENT_STOCK,
                "sku": error.sku,
                "requested": error.requested,
                "available": error.available,
            }
        )
        found: Rows = yield sa.select(idempotency_keys).where(idempotency_keys.c.key == key)
        stored = found.first()
        if stored is not None:
            return self.replay(stored, operation, print_)
        yield sa.insert(idempotency_keys).values(
            key=key, fingerprint=print_, operation=operation, outcome=outcome, created_ms=db_now_ms()
        )
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
        return sa.insert(sku_history).values(
            self._history_values(
                lease,
                sku,
                operation,
                key,
                kind="rejected",
                token=stale.presented,
                quantity=quantity,
                reservation_id=reservation_id,
                highest_token=stale.highest,
                detail=str(stale),
            )
        )

    @staticmethod
    def _history_values(
        lease: Lease,
        sku: str,
        operation: str,
        key: str | None,
        *,
        kind: str,
        token: int,
        quantity: int | None,
        on_hand: int = 0,
        reserved: int = 0,
        reservation_id: str | None = None,
        highest_token: int | None = None,
        detail: str | None = None,
    ) -> dict[str, Any]:
        return {
            "sku": sku,
            "at_ms": db_now_ms(),
            "kind": kind,
            "operation": operation,
            "token": token,
            "lease_id": lease.lease_id,
            "holder": lease.holder,
            "quantity": quantity,
            "idempotency_key": key,
            "reservation_id": reservation_id,
            "on_hand_delta": on_hand,
            "reserved_delta": reserved,
            "highest_token": highest_token,
            "detail": detail,
        }

    # -- building blocks ---------------------------------------------------------------------------

    def _fenced(
        self,
        lease: Lease,
        sku: str,
        operation: str,
        *,
        on_hand: int,
        reserved: int,
        condition: sa.ColumnElement[bool] | None,
    ) -> Plan[StockLevel]:
        """The fenced stock change; UnknownSku if there is no row, None-safe condition check.

        Units coming in must keep ``on_hand`` within MAX_ON_HAND; the bound is part of the UPDATE's own
        condition, so two restocks racing each other cannot both pass it.
        """
        if on_hand > 0:
            # Compared against a bound computed here: ``on_hand + delta`` could overflow in SQL first.
            within = stock.c.on_hand <= valid.MAX_ON_HAND - on_hand
            condition = within if condition is None else sa.and_(condition, within)
        result = yield from self.fence.plan(
            lease,
            scope=valid.scope_of(sku),
            where=[stock.c.sku == sku],
            values={
                "on_hand": stock.c.on_hand + on_hand,
                "reserved": stock.c.reserved + reserved,
                "available": stock.c.available + (on_hand - reserved),
                "updated_ms": db_now_ms(),
            },
            condition=condition,
            returning=STOCK_COLUMNS,
            operation=operation,
        )
        if result.outcome is FenceOutcome.NO_ROW:
            raise UnknownSku(sku)
        if result.outcome is FenceOutcome.CONDITION_FAILED:
            level = yield from stock_level(sku)
            if on_hand > 0 and level.on_hand > valid.MAX_ON_HAND - on_hand:
                limit = valid.MAX_ON_HAND
                raise StockLimitExceeded(sku=sku, on_hand=level.on_hand, delta=on_hand, limit=limit)
            raise InsufficientStock(sku=sku, requested=max(reserved, -on_hand), available=level.available)
        row = result.row
        return StockLevel(sku=row[0], on_hand=row[1], reserved=row[2], available=row[3], fence_token=row[4])

    def _history(
        self,
        lease: Lease,
        sku: str,
        operation: str,
        key: str | None,
        *,
        quantity: int,
        on_hand: int,
        reserved: int,
        reservation_id: str | None = None,
        detail: str | None = None,
    ) -> sa.Executable:
        return sa.insert(sku_history).values(
            self._history_values(
                lease,
                sku,
                operation,
                key,
                kind="write",
                token=lease.token,
                quantity=quantity,
                on_hand=on_hand,
                reserved=reserved,
                reservation_id=reservation_id,
                detail=detail,
            )
        )

    def hold_line(
        self,
        lease: Lease,
        sku: str,
        quantity: int,
        *,
        key: str,
        reservation_key: str,
        order_key: str | None,
        hold_ms: int | None,
        operation: str,
    ) -> Plan[tuple[str, StockLevel]]:
        level = yield from self._fenced(
            lease, sku, operation, on_hand=0, reserved=quantity, condition=stock.c.available >= quantity
        )
        reservation_id = new_reservation_id()
        now = db_now_ms()
        yield sa.insert(reservations).values(
            id=reservation_id,
            sku=sku,
            quantity=quantity,
            status=HELD,
            hold_expires_ms=None if hold_ms is None else now + hold_ms,
            idempotency_key=reservation_key,
            order_key=order_key,
            token=lease.token,
            lease_id=lease.lease_id,
            created_ms=now,
        )
        yield self._history(
            lease,
            sku,
            operation,
            key,
            quantity=quantity,
            on_hand=0,
            reserved=quantity,
            reservation_id=reservation_id,
        )
        return reservation_id, level

    def hold_together(self, lease: Lease, sku: str, held: list[HeldLine]) -> Plan[StockLevel]:
        """Hold every line of ``held`` (one SKU, decided by the caller against the stock row it locked)
        with one fenced stock change for their total and one insert each for their reservations and
        history rows: three statements for a batch of any size. PostgreSQL only, where the held-units
        check counts a statement's reservations together (migration 0007); returns the level after."""
        total = sum(line.quantity for line in held)
        level = yield from self._fenced(
            lease, sku, "reserve", on_hand=0, reserved=total, condition=stock.c.available >= total
        )
        now = db_now_ms()
        yield sa.insert(reservations).values(
            [
                {
                    "id": line.reservation_id,
                    "sku": sku,
                    "quantity": line.quantity,
                    "status": HELD,
                    "hold_expires_ms": None if line.hold_ms is None else now + line.hold_ms,
                    "idempotency_key": line.key,
                    "order_key": None,
                    "token": lease.token,
                    "lease_id": lease.lease_id,
                    "created_ms": now,
                }
                for line in held
            ]
        )
        yield sa.insert(sku_history).values(
            [
                self._history_values(
                    lease,
                    sku,
                    "reserve",
                    line.key,
                    kind="write",
                    token=lease.token,
                    quantity=line.quantity,
                    reserved=line.quantity,
                    reservation_id=line.reservation_id,
                )
                for line in held
            ]
        )
        return level

    def hold_one(self, lease: Lease, sku: str, quantity: int, key: str, hold_ms: int | None) -> Plan[Outcome]:
        """The body of a single-SKU reservation (alone, or as one request of a batch)."""
        reservation_id, level = yield from self.hold_line(
            lease,
            sku,
            quantity,
            key=key,
            reservation_key=key,
            order_key=None,
            hold_ms=hold_ms,
            operation="reserve",
        )
        return Outcome.reserved(key, lease.token, reservation_id, level, quantity)

    # -- operations --------------------------------------------------------------------------------

    def add_sku(self, sku: str, on_hand: int) -> Plan[StockLevel]:
        """Create a SKU's stock row (unfenced: no owner can exist for a row that does not)."""
        valid.sku(sku)
        valid.on_hand(on_hand)
        created: StockLevel = yield Atomic(self._add_sku(sku, on_hand))
        return created

    def _add_sku(self, sku: str, on_hand: int) -> Plan[StockLevel]:
        found: Rows = yield sa.select(stock.c.sku).where(stock.c.sku == sku)
        if found.first() is not None:
            raise InvalidRequest(f"SKU {sku!r} already exists", field="sku")
        yield sa.insert(stock).values(
            sku=sku, on_hand=on_hand, reserved=0, available=on_hand, fence_token=0, updated_ms=db_now_ms()
        )
        yield sa.insert(sku_history).values(
            sku=sku,
            at_ms=db_now_ms(),
            kind="write",
            operation="create",
            token=0,
            quantity=on_hand,
            on_hand_delta=on_hand,
            reserved_delta=0,
        )
        return StockLevel(sku=sku, on_hand=on_hand, reserved=0, available=on_hand, fence_token=0)

    def purge_idempotency(self, older_than: float) -> Plan[int]:
        """Delete idempotency records older than ``older_than`` seconds (database clock)."""
        purged: int = yield Atomic(self._purge(round(valid.retention(older_than) * 1000)))
        return purged

    def _purge(self, older_than_ms: int) -> Plan[int]:
        gone: Rows = yield (
            sa.delete(idempotency_keys)
            .where(idempotency_keys.c.created_ms < db_now_ms() - older_than_ms)
            .returning(idempotency_keys.c.key)
        )
        return len(gone.rows)

    def restock(self, lease: Lease, sku: str, quantity: int, key: str) -> Plan[Outcome]:
        valid.lease(lease)
        valid.sku(sku)
        valid.quantity(quantity)
        valid.idempotency_key(key)
        return self._change_on_hand(lease, sku, quantity, key, "restock", None)

    def adjust(
        self, lease: Lease, sku: str, delta: int, key: str, reason: str | None = None
    ) -> Plan[Outcome]:
        valid.lease(lease)
        valid.sku(sku)
        valid.delta(delta)
        valid.idempotency_key(key)
        valid.text(reason, field="reason", max_chars=valid.MAX_REASON_CHARS)
        return self._change_on_hand(lease, sku, delta, key, "adjust", reason)

    def _change_on_hand(
        self, lease: Lease, sku: str, delta: int, key: str, operation: str, reason: str | None
    ) -> Plan[Outcome]:
        def apply() -> Plan[Outcome]:
            condition = None if delta > 0 else stock.c.available >= -delta
            level = yield from self._fenced(
                lease, sku, operation, on_hand=delta, reserved=0, condition=condition
            )
            yield self._history(
                lease, sku, operation, key, quantity=delta, on_hand=delta, reserved=0, detail=reason
            )
            return Outcome(operation=operation, key=key, token=lease.token, stock=(level,), quantity=delta)

        return self._idempotent(
            key,
            operation,
            fingerprint(operation, sku=sku, delta=delta, reason=reason),
            apply,
            lambda stale: self.rejection(stale, lease, sku, operation, key, delta),
            self._lock_skus(sku),
        )

    def reserve(
        self, lease: Lease, sku: str, quantity: int, key: str, hold_for: float | None = None
    ) -> Plan[Outcome]:
        hold_ms, print_ = _checked_reserve(lease, sku, quantity, key, hold_for)
        return self._reserve(lease, sku, quantity, key, hold_ms, print_)

    def _reserve(
        self, lease: Lease, sku: str, quantity: int, key: str, hold_ms: int | None, print_: str
    ) -> Plan[Outcome]:
        if self.single_statement:
            return self._reserve_alone(lease, sku, quantity, key, hold_ms, print_)

        def apply() -> Plan[Outcome]:
            return (yield from self.hold_one(lease, sku, quantity, key, hold_ms))

        return self._idempotent(
            key,
            "reserve",
            print_,
            apply,
            lambda stale: self.rejection(stale, lease, sku, "reserve", key, quantity),
            self._lock_skus(sku),
        )

    def _reserve_in_one(
        self,
        lease: Lease,
        sku: str,
        quantity: int,
        key: str,
        hold_ms: int | None,
        print_: str,
        speaker: reserve_statement.Speaker | None = None,
    ) -> Plan[reserve_statement.Reply]:
        """:meth:`reserve` as the one statement of :mod:`reservations.reserve_statement`."""
        scope = valid.scope_of(sku)
        if lease.lost or lease.scope != scope:
            # Refused without writing, but the key comes first, as on every path: a request that
            # already ended, or a key with a record, is answered from it whatever lease is presented.
            if speaker is not None:
                ended: RequestResult | None = yield from request_outcome(key)
                if ended is not None:
                    return reserve_statement.Reply(ended=ended)
            found: Rows = yield Alone(_RECORD, {"key": key})
            if found.rows:
                return reserve_statement.Reply(prior=reserve_statement.Prior(*found.rows[0]))
        self.fence.prepare(lease, scope)
        clashed = False
        for _ in range(3):
            try:
                reply: reserve_statement.Reply = yield from reserve_statement.reserve(
                    lease,
                    sku,
                    quantity,
                    key=key,
                    fingerprint=print_,
                    hold_ms=hold_ms,
                    reservation_id=new_reservation_id(),
                    enforce=self.fence.enforce,
                    speaker=speaker,
                )
                return reply
            except StaleToken as stale:
                yield Atomic(self.one(self.rejection(stale, lease, sku, "reserve", key, quantity)))
                raise
            except IntegrityError as exc:
                # The statement reads the key on its starting snapshot, so a copy of the request (or
                # another request under the key) committed while it waited on the row lock shows up
                # here, as whichever of the key's rows the database inserted first: look again. Only a
                # reservation that still clashes when the key has neither record nor outcome is one
                # whose record was purged.
                taken = _key_taken(exc)
                if taken is None:
                    raise
                if taken == "reservation":
                    if clashed:
                        raise _reservation_conflict(key, "reserve") from None
                    clashed = True
        raise RuntimeError(f"idempotency key {key!r} kept colliding")  # pragma: no cover

    def _reserve_alone(
        self, lease: Lease, sku: str, quantity: int, key: str, hold_ms: int | None, print_: str
    ) -> Plan[Outcome]:
        reply = yield from self._reserve_in_one(lease, sku, quantity, key, hold_ms, print_)
        if reply.prior is not None:
            return self.replay(reply.prior, "reserve", print_)
        if reply.refused is not None:
            raise reply.refused
        if reply.outcome is None:  # pragma: no cover - the statement answers one of the three
            raise RuntimeError(f"the reservation statement gave no answer for {key!r}")
        return reply.outcome

    def reserve_request(
        self,
        lease: Lease,
        sku: str,
        quantity: int,
        key: str,
        hold_for: float | None,
        speaker: reserve_statement.Speaker,
    ) -> Plan[RequestReply]:
        """A queued reserve request run to its final outcome: the reservation (or refusal), its attempt
        and its outcome row. On PostgreSQL all of it is the one statement; elsewhere, or to replay a key
        whose outcome was never written, the same steps one after another. A request that already
        ended is answered from its outcome. Raises what :meth:`reserve` raises, but never
        :class:`InsufficientStock`: that is an outcome."""
        hold_ms, print_ = _checked_reserve(lease, sku, quantity, key, hold_for)
        who = {"task_id": speaker.task_id, "worker": speaker.worker}
        if self.single_statement:
            reply = yield from self._reserve_in_one(lease, sku, quantity, key, hold_ms, print_, speaker)
            if reply.ended is not None:
                return RequestReply(reply.ended, None)
            if reply.told is not None:
                return RequestReply(reply.told, reply.outcome)
            if reply.prior is None:  # pragma: no cover - the statement answers one of the three
                raise RuntimeError(f"the reservation statement gave no answer for {key!r}")
            replayed: Outcome | InsufficientStock
            try:
                replayed = self.replay(reply.prior, "reserve", print_)
            except InsufficientStock as short:
                replayed = short
        else:
            done: RequestResult | None = yield Atomic(request_outcome(key))
            if done is not None:
                return RequestReply(done, None)
            try:
                replayed = yield from self._reserve(lease, sku, quantity, key, hold_ms, print_)
            except InsufficientStock as short:
                replayed = short
        if isinstance(replayed, InsufficientStock):
            stored = yield from record_outcome(
                key, "reserve", RequestStatus.INSUFFICIENT_STOCK, replayed.summary(),
                epochs=speaker.epochs, fingerprint=print_, **who,
            )  # fmt: skip
            return RequestReply(stored, None)
        result = AttemptResult.REPLAYED if replayed.replayed else AttemptResult.APPLIED
        yield from record_attempt(key, "reserve", result, token=replayed.token, **who)
        stored = yield from record_outcome(
            key, "reserve", RequestStatus.RESERVED, replayed.summary(),
            epochs=speaker.epochs, fingerprint=print_, **who,
        )  # fmt: skip
        return RequestReply(stored, replayed)

    def reserve_many(
        self,
        leases: Mapping[str, Lease],
        lines: list[tuple[str, int]],
        key: str,
        hold_for: float | None = None,
    ) -> Plan[Outcome]:
        """All lines or none. Leases must cover every SKU (take them in :func:`lock_order`)."""
        valid.leases(leases)
        order = valid.order_lines(lines)
        valid.idempotency_key(key)
        hold_ms = hold_ms_of(hold_for)
        missing = [sku for sku, _ in order if sku not in leases]
        if missing:
            raise InvalidRequest(f"no lease for SKU(s) {', '.join(missing)}", field="leases")

        def apply() -> Plan[Outcome]:
            ids, levels = [], []
            for sku, quantity in order:
                reservation_id, level = yield from self.hold_line(
                    leases[sku],
                    sku,
                    quantity,
                    key=key,
                    reservation_key=f"{key} {sku}",
                    order_key=key,
                    hold_ms=hold_ms,
                    operation="reserve_many",
                )
                ids.append(reservation_id)
                levels.append(level)
            return Outcome(
                operation="reserve_many",
                key=key,
                token=None,
                reservation_ids=tuple(ids),
                stock=tuple(levels),
                quantity=sum(q for _, q in order),
            )

        def on_stale(stale: StaleToken) -> sa.Executable:
            sku = stale.scope.removeprefix("sku:")
            quantity = dict(order).get(sku)
            return self.rejection(stale, leases[sku], sku, "reserve_many", key, quantity)

        return self._idempotent(
            key,
            "reserve_many",
            fingerprint("reserve_many", lines=order, hold_ms=hold_ms),
            apply,
            on_stale,
            self._lock_skus(*(sku for sku, _ in order)),
        )

    def _finish(
        self, lease: Lease, reservation_id: str, key: str, operation: str, status: str
    ) -> Plan[Outcome]:
        valid.lease(lease)
        valid.reservation_id(reservation_id)
        valid.idempotency_key(key)
        sku_box: list[str] = []

        def apply() -> Plan[Outcome]:
            found: Rows = yield sa.select(reservations).where(reservations.c.id == reservation_id)
            row = found.first()
            if row is None:
                raise UnknownReservation(reservation_id)
            sku_box.append(row.sku)
            if valid.scope_of(row.sku) != lease.scope:
                raise InvalidTransition(
                    reservation_id=reservation_id,
                    status=row.status,
                    operation=operation,
                    detail=f"it belongs to SKU {row.sku}, the lease is for {lease.scope}",
                )
            if row.status != HELD:
                raise InvalidTransition(reservation_id=reservation_id, status=row.status, operation=operation)
            on_hand = -row.quantity if status == CONFIRMED else 0
            level = yield from self._fenced(
                lease, row.sku, operation, on_hand=on_hand, reserved=-row.quantity, condition=None
            )
            changed: Rows = yield (
                sa.update(reservations)
                .where(reservations.c.id == reservation_id, reservations.c.status == HELD)
                .values(status=status, final_ms=db_now_ms(), final_token=lease.token, final_key=key)
                .returning(reservations.c.id)
            )
            if not changed.rows:  # finished (or expired) by someone else since we read it: roll back
                raise InvalidTransition(reservation_id=reservation_id, status="final", operation=operation)
            yield self._history(
                lease,
                row.sku,
                operation,
                key,
                quantity=row.quantity,
                on_hand=on_hand,
                reserved=-row.quantity,
                reservation_id=reservation_id,
            )
            return Outcome(
                operation=operation,
                key=key,
                token=lease.token,
                reservation_ids=(reservation_id,),
                stock=(level,),
                quantity=row.quantity,
            )

        return self._idempotent(
            key,
            operation,
            fingerprint(operation, reservation_id=reservation_id),
            apply,
            lambda stale: self.rejection(
                stale, lease, sku_box[-1] if sku_box else "?", operation, key, None, reservation_id
            ),
            self._lock_reservation_sku(reservation_id),
        )

    def confirm(self, lease: Lease, reservation_id: str, key: str) -> Plan[Outcome]:
        """The held units become a committed deduction: they leave ``on_hand`` and ``reserved``."""
        return self._finish(lease, reservation_id, key, "confirm", CONFIRMED)

    def release(self, lease: Lease, reservation_id: str, key: str) -> Plan[Outcome]:
        """The held units go back to ``available`` (cancel is the same operation)."""
        return self._finish(lease, reservation_id, key, "release", RELEASED)

    def expire_due(self, lease: Lease, sku: str, key: str | None = None) -> Plan[Outcome]:
        """Every held reservation of ``sku`` whose hold has passed (database clock) goes back."""
        valid.lease(lease)
        valid.sku(sku)
        if key is not None:
            valid.idempotency_key(key)

        def apply() -> Plan[Outcome]:
            # Runs after the stock row is locked: a confirm or release of one of the due reservations
            # queues behind it, so no unit can be returned twice.
            due: Rows = yield sa.select(reservations.c.id, reservations.c.quantity).where(
                reservations.c.sku == sku,
                reservations.c.status == HELD,
                reservations.c.hold_expires_ms <= db_now_ms(),
            )
            total = sum(r.quantity for r in due.rows)
            if not due.rows:
                level = yield from stock_level(sku)
                lease.raise_if_lost()
                return Outcome(operation="expire", key=key, token=lease.token, stock=(level,))
            ids = tuple(r.id for r in due.rows)
            for r in due.rows:
                # One reservation at a time, stock first: the database checks after every reservation
                # row that the SKU's reserved units equal its held reservations.
                level = yield from self._fenced(
                    lease, sku, "expire", on_hand=0, reserved=-r.quantity, condition=None
                )
                yield (
                    sa.update(reservations)
                    .where(reservations.c.id == r.id, reservations.c.status == HELD)
                    .values(status=EXPIRED, final_ms=db_now_ms(), final_token=lease.token, final_key=key)
                )
                yield self._history(
                    lease,
                    sku,
                    "expire",
                    key,
                    quantity=r.quantity,
                    on_hand=0,
                    reserved=-r.quantity,
                    reservation_id=r.id,
                )
            return Outcome(
                operation="expire",
                key=key,
                token=lease.token,
                reservation_ids=ids,
                stock=(level,),
                quantity=total,
            )

        on_stale = lambda stale: self.rejection(stale, lease, sku, "expire", key, None)  # noqa: E731
        lock = self._lock_skus(sku)
        if key is None:
            return self._unkeyed(apply, on_stale, lock)
        return self._idempotent(key, "expire", fingerprint("expire", sku=sku), apply, on_stale, lock)

    def _unkeyed(
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
            yield Atomic(self.one(on_stale(stale)))
            raise
