"""Batched reservations of a hot SKU: whoever holds the SKU's lease serves its pending list
(:mod:`reservations.pending`) oldest first, each batch one fenced transaction under its token that also
writes every served request's final outcome and removes it from the list.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from fencing import Lease, StaleToken
from fencing.plan import Atomic, Plan
from fencing.sql import Rows
from reservations import batch_statement
from reservations import validation as valid
from reservations.batch_statement import InHand
from reservations.collisions import KeptColliding, rounds
from reservations.errors import (
    IdempotencyConflict,
    InsufficientStock,
    InvalidRequest,
    RequestClosed,
    UnknownSku,
)
from reservations.ledger import (
    HeldLine,
    Ledger,
    Shell,
    closed,
    fingerprint,
    new_reservation_id,
    one,
    record,
    reservation_conflict,
    short,
)
from reservations.ledger import records as ledger_records
from reservations.lifecycle import hold_one
from reservations.models import idempotency_keys, pending_reservations, request_outcomes, reservations, stock
from reservations.reads import STOCK_COLUMNS
from reservations.request_outcomes import RequestResult, attempts_written, outcomes_written, result_of
from reservations.reserve_statement import Prior
from reservations.statuses import AttemptResult, RequestStatus
from reservations.values import Outcome, StockLevel

MAX_BATCH = 1000


def serve_pending(
    inventory: Shell,
    lease: Lease,
    sku: str,
    *,
    limit: int = 100,
    task_id: str | None = None,
    worker: str | None = None,
    in_hand: Sequence[InHand] = (),
) -> Plan[list[RequestResult]]:
    """Serve up to ``limit`` pending reservations of ``sku``, then the requests ``in_hand`` (handed over
    by threads of the caller's process, never listed), in one fenced transaction.

    Returns the final outcomes written (empty: nothing was pending or in hand). A request in hand whose
    key had already ended gets none (its sender reads the key). A stale token rolls the whole batch back,
    is recorded in the SKU's history, and raises: the requests stay pending for the next holder.
    """
    ledger = inventory.ledger
    valid.lease(lease)
    valid.task_and_worker(task_id, worker)
    valid.sku(sku)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_BATCH:
        raise InvalidRequest(f"batch limit must be between 1 and {MAX_BATCH}", field="limit")
    if valid.scope_of(sku) != lease.scope:
        raise InvalidRequest(f"the lease is for {lease.scope}, not SKU {sku!r}", field="lease")
    if len(in_hand) > MAX_BATCH:
        raise InvalidRequest(f"at most {MAX_BATCH} requests in hand", field="in_hand")
    for request in in_hand:
        if request.sku != sku:
            raise InvalidRequest(f"a request in hand is for {request.sku!r}, not {sku!r}", field="in_hand")
        # As the pending list checks them (pending.hand_off): what a request in hand writes must be a
        # request's, whoever handed it.
        valid.idempotency_key(request.key)
        valid.quantity(request.quantity)
        valid.hold_ms(request.hold_ms)
        valid.epochs(request.epochs)
        valid.task_and_worker(request.task_id)
    lease.raise_if_lost()
    # The list's requests are older than those in hand: read first, with room left for the hand's.
    listed = max(1, limit - len(in_hand))

    try:
        # A request of this batch that got its outcome elsewhere meanwhile (its own retry dead-lettered
        # it) fails the batch on its key: the next round sees that and only removes it from the list.
        for round_ in rounds():
            with round_:
                served: list[RequestResult] = yield Atomic(
                    _batch(ledger, lease, sku, listed, task_id, worker, tuple(in_hand))
                )
                return served
    except StaleToken as stale:
        yield Atomic(one(ledger.rejection(stale, lease, sku, "reserve", None, None)))
        raise
    raise KeptColliding(f"the pending reservations of {sku!r}")


def _batch(
    ledger: Ledger,
    lease: Lease,
    sku: str,
    limit: int,
    task_id: str | None,
    worker: str | None,
    in_hand: tuple[InHand, ...],
) -> Plan[list[RequestResult]]:
    # The stock row first, as every operation on the SKU does: batches and single requests queue here.
    locked: Rows = yield (
        sa.select(*STOCK_COLUMNS, stock.c.fence_lease_id).where(stock.c.sku == sku).with_for_update()
    )
    row = locked.first()
    known = row is not None
    while True:
        if ledger.single_statement:  # PostgreSQL: one text for any number in hand (batch_statement)
            read = yield from batch_statement.waiting(sku, limit, in_hand)
        else:
            found: Rows = yield _waiting(sku, limit, in_hand)
            read = found.rows
        # A key read twice (a copy of a listed request in hand too) is served once, where it came first.
        first: dict[str, Any] = {}
        for r in read:
            first.setdefault(r.key, r)
        waiting = list(first.values())
        if not waiting:
            return []
        keys = [r.key for r in waiting]
        done = {r.key for r in waiting if r.ended}
        if len(done) < len(waiting):
            break
        # Every request read had ended elsewhere: drop them and read on, so that an empty answer always
        # means an empty queue (a server stops on one). Those in hand are read once.
        yield sa.delete(pending_reservations).where(pending_reservations.c.key.in_(keys))
        in_hand = ()
    stored = {
        r.key: Prior(r.key, r.stored_fingerprint, r.stored_operation, r.stored_outcome)
        for r in waiting
        if r.stored_fingerprint is not None
    }
    # A key whose record was purged while its reservation lives on would collide with that reservation
    # (and fail the whole batch, every time): it is a conflict, as for a single reserve.
    clashing = {r.key for r in waiting if r.clashing and r.key not in done and r.key not in stored}

    hold: Hold
    allotted: list[HeldLine] = []
    if ledger.single_statement and row is not None:
        # PostgreSQL: judged here against the row this transaction locked, written below as one fenced
        # change for the batch's total; a lease the row refuses serves nothing, as with one write each.
        ledger.fence.refuse_if_stale(lease, lease.scope, int(row.fence_token), row.fence_lease_id, "reserve")
        hold = _Allotment(lease, StockLevel(*row[:5]), allotted).hold
    else:

        def hold(request: Any) -> Plan[Outcome]:
            return hold_one(ledger, lease, request.sku, request.quantity, request.key, request.hold_ms)

    records: list[dict[str, Any]] = []
    outcomes: list[dict[str, Any]] = []
    attempts: list[dict[str, Any]] = []
    serving = sum(1 for r in waiting if r.key not in done)
    for request in waiting:
        if request.key in done:
            continue
        print_ = fingerprint("reserve", sku=request.sku, quantity=request.quantity, hold_ms=request.hold_ms)
        status, detail, attempt = yield from _serve_one(
            ledger, lease, hold, request, print_, known, stored, clashing, records
        )
        detail["served_by"] = task_id
        outcomes.append(
            {
                "key": request.key,
                "operation": "reserve",
                "status": status,
                "detail": json.dumps(detail, sort_keys=True),
                "task_id": request.task_id,
                "worker": worker,
                "epochs": request.epochs,
                "fingerprint": print_,
            }
        )
        attempts.append(
            {
                "key": request.key,
                "operation": "reserve",
                "result": attempt,
                "task_id": task_id,
                "worker": worker,
                "token": lease.token,
                "detail": f"served in a batch of {serving} for task {request.task_id}",
            }
        )
    if ledger.single_statement and row is not None:
        # PostgreSQL: every write of the batch in one statement, sent as it is (batch_statement).
        if allotted:
            ledger.fence.prepare(lease, lease.scope)
        return (
            yield from batch_statement.write(
                ledger.fence, lease, sku, allotted, records, outcomes, attempts, keys
            )
        )
    if records:
        yield ledger_records(*records)
    written = Rows([])
    if outcomes:
        # The rows as written (their time is the database's): what the batch returns.
        written = yield outcomes_written(*outcomes).returning(*request_outcomes.c)
        yield attempts_written(*attempts)
    yield sa.delete(pending_reservations).where(pending_reservations.c.key.in_(keys))
    return [result_of(r) for r in written.rows]


_REQUEST = ("key", "sku", "quantity", "hold_ms", "task_id", "epochs")


def _waiting(sku: str, limit: int, in_hand: tuple[InHand, ...]) -> sa.Select[Any]:
    """The SKU's oldest waiting requests, then those in hand, each with whether it ended elsewhere, its
    idempotency record if it has one, and whether a reservation holds its key: one round trip for what
    the batch decides on."""
    listed = pending_reservations.c
    queue: Any = (
        sa.select(*(listed[name] for name in _REQUEST), listed.id.label("place"))
        .where(listed.sku == sku)
        .order_by(listed.id)
        .limit(limit)
    )
    if in_hand:
        # After every listed request (ids are positive: in hand, -1, -2, ... in the order handed).
        handed = [
            sa.select(
                *(sa.literal(getattr(request, name), listed[name].type).label(name) for name in _REQUEST),
                sa.literal(-(n + 1), sa.BigInteger).label("place"),
            )
            for n, request in enumerate(in_hand)
        ]
        queue = sa.union_all(queue.subquery().select(), *handed)
    waiting = queue.subquery("waiting")
    ended, record = request_outcomes.c, idempotency_keys.c
    return (
        sa.select(
            *(waiting.c[name] for name in _REQUEST),
            ended.key.is_not(None).label("ended"),
            record.fingerprint.label("stored_fingerprint"),
            record.operation.label("stored_operation"),
            record.outcome.label("stored_outcome"),
            sa.exists().where(reservations.c.idempotency_key == waiting.c.key).label("clashing"),
        )
        .select_from(
            waiting.outerjoin(request_outcomes, ended.key == waiting.c.key).outerjoin(
                idempotency_keys, record.key == waiting.c.key
            )
        )
        .order_by(waiting.c.place < 0, sa.func.abs(waiting.c.place))
    )


Hold = Callable[[Any], Plan[Outcome]]


@dataclass(slots=True)
class _Allotment:
    """Holds a batch's requests in arrival order against the level of the stock row its transaction
    locked, without a statement each: the units go to :func:`reservations.batch_statement.write` afterwards.
    Each request sees the level the ones before it left, so stock runs out in arrival order exactly as
    with one fenced write per request, and its outcome reports the level after it."""

    lease: Lease
    level: StockLevel
    held: list[HeldLine]

    def hold(self, request: Any) -> Plan[Outcome]:
        level, quantity = self.level, request.quantity
        if level.available < quantity:
            raise InsufficientStock(sku=level.sku, requested=quantity, available=level.available)
        line = HeldLine(request.key, quantity, request.hold_ms, new_reservation_id())
        self.held.append(line)
        self.level = level = StockLevel(
            sku=level.sku,
            on_hand=level.on_hand,
            reserved=level.reserved + quantity,
            available=level.available - quantity,
            fence_token=self.lease.token,
        )
        return Outcome.reserved(request.key, self.lease.token, line.reservation_id, level, quantity)
        yield  # pragma: no cover - a plan that sends nothing


def _serve_one(
    ledger: Ledger,
    lease: Lease,
    hold: Hold,
    request: Any,
    print_: str,
    known: bool,
    stored: dict[str, Any],
    clashing: set[str],
    records: list[dict[str, Any]],
) -> Plan[tuple[str, dict[str, Any], str]]:
    """One request of a batch: (final status, detail, attempt result). Records it adds go to ``records``."""
    sku, key = request.sku, request.key

    try:
        if not known:
            raise UnknownSku(sku)
        if key in stored:
            outcome = ledger.replay(stored[key], "reserve", print_)
            return RequestStatus.RESERVED, outcome.summary(), AttemptResult.REPLAYED
        if key in clashing:
            raise reservation_conflict(key, "reserve")
        outcome = yield from hold(request)
        records.append(record(key, print_, "reserve", outcome.to_json(), lease.token))
        return RequestStatus.RESERVED, outcome.summary(), AttemptResult.APPLIED
    except InsufficientStock as refused:
        if not getattr(refused, "replayed", False):
            records.append(short(key, print_, "reserve", refused))
        return RequestStatus.INSUFFICIENT_STOCK, refused.summary(), AttemptResult.INSUFFICIENT_STOCK
    except (UnknownSku, RequestClosed, IdempotencyConflict) as invalid:
        if key not in stored:  # close the key, as every request that ends without effect does
            records.append(closed(key, "reserve", RequestStatus.INVALID))
        return (
            RequestStatus.INVALID,
            {"error": type(invalid).__name__, "message": str(invalid)},
            AttemptResult.INVALID,
        )
