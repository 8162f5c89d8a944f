"""The inventory's operations as plans: the one core behind :class:`Inventory` and
:class:`AsyncInventory`. Adding a SKU and reservations (one SKU, one request of a queue, or an order of
several SKUs, all or nothing); the envelope is :mod:`reservations.ledger`, restocks and adjustments are
:mod:`reservations.on_hand`'s, counts and replenishment to par :mod:`reservations.counting`'s; the later
steps run alone or as queued requests through :mod:`reservations.keyed_steps`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import sqlalchemy as sa

from fencing import Fence, Lease, StaleToken
from fencing.plan import Alone, Atomic, Plan
from fencing.sql import Rows, db_now_ms
from reservations import keyed_steps, reserve_statement
from reservations import validation as valid
from reservations.collisions import KeptColliding, rounds
from reservations.counting import StockCounting, StockSeen
from reservations.errors import InsufficientStock, InvalidRequest, KeyTaken
from reservations.ledger import (
    HeldLine,
    Ledger,
    fingerprint,
    hold_ms_of,
    new_reservation_id,
    reservation_conflict,
)
from reservations.lifecycle import ReservationLifecycle
from reservations.models import CONFIRMED, RELEASED, idempotency_keys, sku_history, stock
from reservations.on_hand import OnHandChanges
from reservations.requests import RequestReply, RequestResult, request_outcome
from reservations.reserve_statement import Speaker
from reservations.statuses import RequestStatus
from reservations.views import Outcome, StockLevel

__all__ = ["HeldLine", "InventoryPlans", "fingerprint", "hold_ms_of", "new_reservation_id"]


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
    """Decisions and statements for every inventory operation; no I/O. Composed of the ledger (the
    envelope every fenced write shares), the reservation lifecycle, stock counting and the on-hand
    changes; the operations that start a reservation are its own."""

    def __init__(
        self,
        *,
        enforce_fence: bool = True,
        before_statement: Callable[[Lease], None] | None = None,
        single_statement: bool = False,
    ) -> None:
        self.ledger = Ledger(
            enforce_fence=enforce_fence, before_statement=before_statement, single_statement=single_statement
        )
        self.lifecycle = ReservationLifecycle(self.ledger)
        self.counting = StockCounting(self.ledger)
        self.on_hand = OnHandChanges(self.ledger)

    @property
    def fence(self) -> Fence:
        return self.ledger.fence

    @property
    def single_statement(self) -> bool:
        return self.ledger.single_statement

    # -- the later steps as queued requests (keyed_steps.request) ------------------------------------
    # Each runs its step to the request's final outcome as reserve_request does a reservation, raising
    # what the step raises. A worker holding the step's lease (a count or a replenishment having read
    # ``seen`` under it) calls it in place of the request's outcome check, the step, record_attempt and
    # record_outcome, e.g. ``executor.run(plans.confirm_request(lease, reservation_id, key,
    # Speaker(task_id, worker, epochs)))``, and answers with the reply's ``result``.

    def confirm_request(
        self, lease: Lease, reservation_id: str, key: str, speaker: Speaker
    ) -> Plan[RequestReply]:
        return keyed_steps.request(
            self.ledger, self.lifecycle.finish_step(lease, reservation_id, key, CONFIRMED), speaker
        )

    def release_request(
        self, lease: Lease, reservation_id: str, key: str, speaker: Speaker
    ) -> Plan[RequestReply]:
        return keyed_steps.request(
            self.ledger, self.lifecycle.finish_step(lease, reservation_id, key, RELEASED), speaker
        )

    def restock_request(
        self, lease: Lease, sku: str, quantity: int, key: str, speaker: Speaker
    ) -> Plan[RequestReply]:
        return keyed_steps.request(self.ledger, self.on_hand.restock_step(lease, sku, quantity, key), speaker)

    def count_request(
        self, lease: Lease, sku: str, counted: int, key: str, speaker: Speaker, *,
        seen: StockSeen | None = None, shrinkage: int | None = None,
    ) -> Plan[RequestReply]:  # fmt: skip
        step = self.counting.count_step(lease, sku, counted, key, seen, shrinkage)
        return keyed_steps.request(self.ledger, step, speaker)

    def replenish_request(
        self, lease: Lease, sku: str, par: int, key: str, speaker: Speaker, *, seen: StockSeen
    ) -> Plan[RequestReply]:
        return keyed_steps.request(
            self.ledger, self.counting.replenish_step(lease, sku, par, key, seen), speaker
        )

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

    def reserve(
        self, lease: Lease, sku: str, quantity: int, key: str, hold_for: float | None = None
    ) -> Plan[Outcome]:
        hold_ms, print_ = _checked_reserve(lease, sku, quantity, key, hold_for)
        return self._reserve(lease, sku, quantity, key, hold_ms, print_)

    def _reserve(
        self, lease: Lease, sku: str, quantity: int, key: str, hold_ms: int | None, print_: str
    ) -> Plan[Outcome]:
        if self.ledger.single_statement:
            return self._reserve_alone(lease, sku, quantity, key, hold_ms, print_)

        def apply() -> Plan[Outcome]:
            return (yield from self.lifecycle.hold_one(lease, sku, quantity, key, hold_ms))

        return self.ledger.idempotent(
            key,
            "reserve",
            print_,
            apply,
            lambda stale: self.ledger.rejection(stale, lease, sku, "reserve", key, quantity),
            self.ledger.lock_skus(sku),
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
                    return reserve_statement.Ended(ended)
            found: Rows = yield Alone(_RECORD, {"key": key})
            if found.rows:
                return reserve_statement.Replay(reserve_statement.Prior(*found.rows[0]))
        self.ledger.fence.prepare(lease, scope)
        clashed = False

        def clash(taken: KeyTaken) -> None:
            # The statement reads the key on its starting snapshot, so a copy of the request (or another
            # request under the key) committed while it waited on the row lock shows up here, as
            # whichever of the key's rows the database inserted first: look again. Only a reservation
            # that still clashes when the key has neither record nor outcome is one whose record was
            # purged.
            nonlocal clashed
            if taken.where == "reservation":
                if clashed:
                    raise reservation_conflict(key, "reserve") from None
                clashed = True

        try:
            for round_ in rounds(on_taken=clash):
                with round_:
                    asked = reserve_statement.Asked(
                        lease, sku, quantity, key, print_, hold_ms, new_reservation_id(), self.ledger.fence,
                        speaker,
                    )  # fmt: skip
                    answer: Rows = yield asked.sent()
                    return asked.reply(answer)
        except StaleToken as stale:
            yield Atomic(self.ledger.one(self.ledger.rejection(stale, lease, sku, "reserve", key, quantity)))
            raise
        raise KeptColliding(f"the reservation under {key!r}")

    def _reserve_alone(
        self, lease: Lease, sku: str, quantity: int, key: str, hold_ms: int | None, print_: str
    ) -> Plan[Outcome]:
        reply = yield from self._reserve_in_one(lease, sku, quantity, key, hold_ms, print_)
        match reply:
            case reserve_statement.Reserved(outcome):
                return outcome
            case reserve_statement.Short(refused):
                raise refused
            case reserve_statement.Replay(prior):
                return self.ledger.replay(prior, "reserve", print_)
            case reserve_statement.Ended():  # pragma: no cover - only a statement with a speaker ends
                raise RuntimeError(f"the reservation statement answered an ended request for {key!r}")

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
        replayed: Outcome | InsufficientStock
        if self.ledger.single_statement:
            reply = yield from self._reserve_in_one(lease, sku, quantity, key, hold_ms, print_, speaker)
            match reply:
                case reserve_statement.Ended(ended):
                    return RequestReply(ended, None)
                case reserve_statement.Reserved(outcome, told) if told is not None:
                    return RequestReply(told, outcome)
                case reserve_statement.Short(_, told) if told is not None:
                    return RequestReply(told, None)
                case reserve_statement.Replay(prior):
                    try:
                        replayed = self.ledger.replay(prior, "reserve", print_)
                    except InsufficientStock as short:
                        replayed = short
                case _:  # pragma: no cover - a statement with a speaker tells what it did
                    raise RuntimeError(f"the reservation statement told nothing for {key!r}")
        else:
            done: RequestResult | None = yield Atomic(request_outcome(key))
            if done is not None:
                return RequestReply(done, None)
            try:
                replayed = yield from self._reserve(lease, sku, quantity, key, hold_ms, print_)
            except InsufficientStock as short:
                replayed = short
        return (
            yield from keyed_steps.recorded(key, "reserve", print_, RequestStatus.RESERVED, speaker, replayed)
        )

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
                reservation_id, level = yield from self.lifecycle.hold_line(
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
            return self.ledger.rejection(stale, leases[sku], sku, "reserve_many", key, quantity)

        return self.ledger.idempotent(
            key,
            "reserve_many",
            fingerprint("reserve_many", lines=order, hold_ms=hold_ms),
            apply,
            on_stale,
            self.ledger.lock_skus(*(sku for sku, _ in order)),
        )
