"""A reservation's life as plans: units held (one SKU, an order of several SKUs all or nothing, or a batch
held together), then confirmed, released or expired. Each step is a fenced write in the ledger's envelope;
a single-SKU reservation, a confirm and a release are also sent as one statement on PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

import sqlalchemy as sa

from fencing import Lease, StaleToken
from fencing.plan import Plan
from fencing.sql import Rows, db_now_ms
from reservations import finish_statement, reserve_statement
from reservations import keyed_statement as keyed
from reservations import validation as valid
from reservations.errors import InvalidRequest, InvalidTransition, UnknownReservation
from reservations.keyed_steps import Step
from reservations.ledger import Ledger, Shell, fingerprint, hold_ms_of, new_reservation_id
from reservations.models import CONFIRMED, EXPIRED, HELD, RELEASED, reservations, stock
from reservations.reads import stock_level
from reservations.statuses import SUCCEEDED, RequestStatus, ReservationStatus
from reservations.values import Outcome, StockLevel

# The operation that ends a hold in each final status.
_OPERATIONS = {CONFIRMED: "confirm", RELEASED: "release"}


def hold_line(
    ledger: Ledger, lease: Lease, sku: str, quantity: int, key: str, hold_ms: int | None, order: bool = False
) -> Plan[tuple[str, StockLevel]]:
    """Units of ``sku`` held under ``key``: a reservation of its own, or a line of the order ``key``."""
    operation = "reserve_many" if order else "reserve"
    available = stock.c.available >= quantity
    level = yield from ledger.fenced(lease, sku, operation, reserved=quantity, condition=available)
    reservation_id = new_reservation_id()
    now = db_now_ms()
    yield sa.insert(reservations).values(
        id=reservation_id, sku=sku, quantity=quantity, status=HELD,
        hold_expires_ms=None if hold_ms is None else now + hold_ms,
        idempotency_key=f"{key} {sku}" if order else key, order_key=key if order else None, token=lease.token,
        lease_id=lease.lease_id, created_ms=now,
    )  # fmt: skip
    yield ledger.history(
        lease, sku, operation, key, quantity=quantity, reserved=quantity, reservation_id=reservation_id
    )
    return reservation_id, level


def hold_one(
    ledger: Ledger, lease: Lease, sku: str, quantity: int, key: str, hold_ms: int | None
) -> Plan[Outcome]:
    """The body of a single-SKU reservation (alone, or as one request of a batch)."""
    reservation_id, level = yield from hold_line(ledger, lease, sku, quantity, key, hold_ms)
    return Outcome.reserved(key, lease.token, reservation_id, level, quantity)


def reserve_step(
    ledger: Ledger, lease: Lease, sku: str, quantity: int, key: str, hold_for: float | None
) -> Step:
    """A single-SKU reservation, checked, both ways it can be sent: as the one statement of
    :mod:`reservations.reserve_statement`, or held in the ledger's envelope."""
    valid.lease(lease)
    valid.sku(sku)
    valid.quantity(quantity)
    valid.idempotency_key(key)
    hold_ms = hold_ms_of(hold_for)
    print_ = fingerprint("reserve", sku=sku, quantity=quantity, hold_ms=hold_ms)

    rejection = partial(
        ledger.rejection, lease=lease, sku=sku, operation="reserve", key=key, quantity=quantity
    )

    def several() -> Plan[Outcome]:  # built only when the step takes it (SQLite, a lost lease)
        held = partial(hold_one, ledger, lease, sku, quantity, key, hold_ms)
        return ledger.idempotent(key, "reserve", print_, held, rejection, ledger.lock_skus(sku))

    send = partial(reserve_statement.exchange, lease, sku, quantity, key, print_, hold_ms)
    written = keyed.Written(lease, key, "reserve", print_, RequestStatus.RESERVED)
    return Step(written, valid.scope_of(sku), several, send, rejection)


def reserve_many(
    inventory: Shell,
    leases: Mapping[str, Lease],
    lines: list[tuple[str, int]],
    *,
    key: str,
    hold_for: float | None = None,
) -> Plan[Outcome]:
    """All lines or none. Leases must cover every SKU (take them in :func:`lock_order`)."""
    ledger = inventory.ledger
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
            reservation_id, level = yield from hold_line(
                ledger, leases[sku], sku, quantity, key, hold_ms, order=True
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
        return ledger.rejection(stale, leases[sku], sku, "reserve_many", key, quantity)

    return ledger.idempotent(
        key,
        "reserve_many",
        fingerprint("reserve_many", lines=order, hold_ms=hold_ms),
        apply,
        on_stale,
        ledger.lock_skus(*(sku for sku, _ in order)),
    )


def finish_step(
    ledger: Ledger, lease: Lease, reservation_id: str, key: str, final: ReservationStatus
) -> Step:
    """The end of a hold (``final``: confirmed or released), checked, both ways it can be sent."""
    valid.lease(lease)
    valid.reservation_id(reservation_id)
    valid.idempotency_key(key)
    operation = _OPERATIONS[final]
    written = keyed.Written(
        lease, key, operation, fingerprint(operation, reservation_id=reservation_id),
        SUCCEEDED[operation],
        reservation_ids=(reservation_id,),
    )  # fmt: skip
    refused = partial(finish_statement.refusal, written, ledger.fence)
    statements, values = finish_statement.STATEMENTS[final], finish_statement.values(written, final)

    def rejection(stale: StaleToken) -> sa.Executable:
        # Refused only once the reservation was found of the lease's SKU (on both paths).
        sku = finish_statement.sku_of(stale.scope) or "?"
        return ledger.rejection(stale, lease, sku, operation, key, None, reservation_id)

    return Step(
        written, None, lambda: _finish(ledger, written, final, rejection),
        partial(keyed.exchange, written, statements, values, refused), rejection,
    )  # fmt: skip


def _finish(
    ledger: Ledger, written: keyed.Written, status: str, rejection: Callable[[StaleToken], sa.Executable]
) -> Plan[Outcome]:
    lease, key, operation = written.lease, written.key, written.operation
    (reservation_id,) = written.reservation_ids

    def apply() -> Plan[Outcome]:
        found: Rows = yield sa.select(reservations).where(reservations.c.id == reservation_id)
        row = found.first()
        if row is None:
            raise UnknownReservation(reservation_id)
        if valid.scope_of(row.sku) != lease.scope:
            raise InvalidTransition(
                reservation_id=reservation_id,
                status=row.status,
                operation=operation,
                detail=f"it belongs to SKU {row.sku}, the lease is for {lease.scope}",
                belongs_to=row.sku,
            )
        if row.status != HELD:
            raise InvalidTransition(reservation_id=reservation_id, status=row.status, operation=operation)
        level = yield from _end(ledger, lease, row.sku, reservation_id, row.quantity, key, operation, status)
        return Outcome(operation, key, lease.token, written.reservation_ids, (level,), row.quantity)

    lock = ledger.lock_reservation_sku(reservation_id)
    return ledger.idempotent(key, operation, written.fingerprint, apply, rejection, lock)


def _end(
    ledger: Ledger, lease: Lease, sku: str, reservation_id: str, quantity: int, key: str | None,
    operation: str, status: str,
) -> Plan[StockLevel]:  # fmt: skip
    """One held reservation ended in ``status``, stock first: the database checks after every
    reservation row that the SKU's reserved units equal its held reservations. InvalidTransition (the
    transaction rolls back) when it was ended by someone else since it was read."""
    on_hand = -quantity if status == CONFIRMED else 0
    level = yield from ledger.fenced(lease, sku, operation, on_hand=on_hand, reserved=-quantity)
    changed: Rows = yield (
        sa.update(reservations)
        .where(reservations.c.id == reservation_id, reservations.c.status == HELD)
        .values(status=status, final_ms=db_now_ms(), final_token=lease.token, final_key=key)
        .returning(reservations.c.id)
    )
    if not changed.rows:
        raise InvalidTransition(reservation_id=reservation_id, status="final", operation=operation)
    yield ledger.history(
        lease, sku, operation, key, quantity=quantity, on_hand=on_hand, reserved=-quantity,
        reservation_id=reservation_id,
    )  # fmt: skip
    return level


def expire_due(inventory: Shell, lease: Lease, sku: str, *, key: str | None = None) -> Plan[Outcome]:
    """Every held reservation of ``sku`` whose hold has passed (database clock) goes back."""
    ledger = inventory.ledger
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
        for r in due.rows:  # one reservation at a time (see _end)
            level = yield from _end(ledger, lease, sku, r.id, r.quantity, key, "expire", EXPIRED)
        return Outcome(
            operation="expire",
            key=key,
            token=lease.token,
            reservation_ids=ids,
            stock=(level,),
            quantity=total,
        )

    on_stale = lambda stale: ledger.rejection(stale, lease, sku, "expire", key, None)  # noqa: E731
    lock = ledger.lock_skus(sku)
    if key is None:
        return ledger.unkeyed(apply, on_stale, lock)
    return ledger.idempotent(key, "expire", fingerprint("expire", sku=sku), apply, on_stale, lock)
