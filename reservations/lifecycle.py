"""A reservation's life as plans: units held (one line, or a batch held together), then confirmed,
released or expired. Each step is a fenced write in the ledger's envelope.
"""

from __future__ import annotations

from functools import partial

import sqlalchemy as sa

from fencing import Lease, StaleToken
from fencing.plan import Plan
from fencing.sql import Rows, db_now_ms
from reservations import finish_statement, keyed_steps
from reservations import keyed_statement as keyed
from reservations import validation as valid
from reservations.errors import InvalidTransition, UnknownReservation
from reservations.keyed_steps import Step
from reservations.ledger import Ledger, fingerprint, new_reservation_id
from reservations.models import CONFIRMED, EXPIRED, HELD, RELEASED, reservations, stock
from reservations.reads import stock_level
from reservations.statuses import SUCCEEDED, ReservationStatus
from reservations.views import Outcome, StockLevel

# The operation that ends a hold in each final status.
_OPERATIONS = {CONFIRMED: "confirm", RELEASED: "release"}


class ReservationLifecycle:
    """Holding units and ending a hold; the operations that start a reservation build on it."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

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
        level = yield from self.ledger.fenced(
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
        yield self.ledger.history(
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

    def finish_step(self, lease: Lease, reservation_id: str, key: str, final: ReservationStatus) -> Step:
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
        refused = partial(finish_statement.refusal, written, self.ledger.fence)

        def rejection(stale: StaleToken) -> sa.Executable:
            # Refused only once the reservation was found of the lease's SKU.
            sku = finish_statement.sku_of(stale.scope) or "?"
            return self.ledger.rejection(stale, lease, sku, operation, key, None, reservation_id)

        return Step(
            written, None, lambda: self._finish(lease, reservation_id, key, operation, final),
            finish_statement.STATEMENTS[final], finish_statement.values(written, final), refused, rejection,
        )  # fmt: skip

    def _finish(
        self, lease: Lease, reservation_id: str, key: str, operation: str, status: str
    ) -> Plan[Outcome]:
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
            level = yield from self.ledger.fenced(
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
            yield self.ledger.history(
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

        return self.ledger.idempotent(
            key,
            operation,
            fingerprint(operation, reservation_id=reservation_id),
            apply,
            lambda stale: self.ledger.rejection(
                stale, lease, sku_box[-1] if sku_box else "?", operation, key, None, reservation_id
            ),
            self.ledger.lock_reservation_sku(reservation_id),
        )

    def confirm(self, lease: Lease, reservation_id: str, key: str) -> Plan[Outcome]:
        """The held units become a committed deduction: they leave ``on_hand`` and ``reserved``."""
        return keyed_steps.alone(self.ledger, self.finish_step(lease, reservation_id, key, CONFIRMED))

    def release(self, lease: Lease, reservation_id: str, key: str) -> Plan[Outcome]:
        """The held units go back to ``available`` (cancel is the same operation)."""
        return keyed_steps.alone(self.ledger, self.finish_step(lease, reservation_id, key, RELEASED))

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
                level = yield from self.ledger.fenced(
                    lease, sku, "expire", on_hand=0, reserved=-r.quantity, condition=None
                )
                yield (
                    sa.update(reservations)
                    .where(reservations.c.id == r.id, reservations.c.status == HELD)
                    .values(status=EXPIRED, final_ms=db_now_ms(), final_token=lease.token, final_key=key)
                )
                yield self.ledger.history(
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

        on_stale = lambda stale: self.ledger.rejection(stale, lease, sku, "expire", key, None)  # noqa: E731
        lock = self.ledger.lock_skus(sku)
        if key is None:
            return self.ledger.unkeyed(apply, on_stale, lock)
        return self.ledger.idempotent(key, "expire", fingerprint("expire", sku=sku), apply, on_stale, lock)
