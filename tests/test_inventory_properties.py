"""Stateful property test of the reservation lifecycle: every operation, replay, key reuse and lease epoch
is predicted by an independent model first, then checked against what the inventory did and stored.
A second test switches the fence off and shows that the same model check catches the stale write.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from fencing import Lease, LeaseLost, LeaseManager, LostOwnership, StaleToken
from fencing.sql import db_now_ms
from reservations import (
    IdempotencyConflict,
    InsufficientStock,
    InvalidTransition,
    Inventory,
    Outcome,
    ReservationError,
    StockLevel,
    scope_of,
)

SETTINGS = settings(
    max_examples=20,
    stateful_step_count=25,
    deadline=None,
    # Every step is several real transactions, and the fixtures hold one database for all examples.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Leases never run out on their own during an example: epochs end only through break_lease.
TTL = 600.0
# Holds as the fingerprint sees them (milliseconds). A 1 ms hold is treated as due at the next
# expire_due; the rule first waits for the database clock to pass it, so nothing depends on timing.
TINY_HOLD_MS = 1
LONG_HOLD_MS = 3_600_000
HOLDS = st.sampled_from([None, LONG_HOLD_MS, TINY_HOLD_MS])
CLOCK_WAIT = 5.0

HELD, CONFIRMED, RELEASED, EXPIRED = "held", "confirmed", "released", "expired"

E = TypeVar("E", bound=Exception)


class ModelMismatch(AssertionError):
    """The inventory did something the model did not predict."""


def agree(what: str, got: object, want: object) -> None:
    if got != want:
        raise ModelMismatch(f"{what}: got {got!r}, model expects {want!r}")


def expect_error(what: str, got: object, kind: type[E]) -> E:
    if not isinstance(got, kind):
        raise ModelMismatch(f"{what}: got {got!r}, model expects {kind.__name__}")
    return got


@dataclass(frozen=True)
class Request:
    """One operation with exactly the fields its idempotency fingerprint covers, so two requests are
    equal precisely when the inventory must treat the second as a replay of the first."""

    op: str  # reserve, reserve_many, restock, adjust, confirm, release, expire
    sku: str | None = None
    quantity: int = 0  # units to reserve or restock; the signed delta of adjust
    hold_ms: int | None = None
    reason: str | None = None
    reservation_id: str | None = None
    lines: tuple[tuple[str, int], ...] = ()  # sorted by SKU, as the fingerprint sorts them


@dataclass(frozen=True)
class Refusal:
    """A stored InsufficientStock: what a replay of its key must raise again."""

    sku: str
    requested: int
    available: int


@dataclass(frozen=True)
class Verdict:
    kind: str  # apply, replay, conflict, invalid, lost, stale, insufficient
    sku: str | None = None
    lease: Lease | None = None
    stored: Outcome | Refusal | None = None
    refusal: Refusal | None = None


@dataclass
class SkuModel:
    name: str
    on_hand: int
    live: Lease  # the real coordinator's newest epoch
    leases: list[Lease]  # every lease ever issued for the SKU, by either coordinator
    reserved: int = 0
    fence: tuple[int, str | None] = (0, None)  # (token, lease id) of the newest accepted write
    rejected: list[tuple[int, int]] = field(default_factory=list)  # (presented, highest) per refusal
    writes: int = 1  # accepted history rows; the first is the create
    amnesiac_issued: int = 0

    @property
    def available(self) -> int:
        return self.on_hand - self.reserved

    @property
    def level(self) -> StockLevel:
        return StockLevel(self.name, self.on_hand, self.reserved, self.available, self.fence[0])

    def accepts(self, lease: Lease) -> bool:
        token, writer = self.fence
        return lease.token > token or (lease.token == token and lease.lease_id == writer)


@dataclass
class ReservationModel:
    id: str
    sku: str
    quantity: int
    hold_ms: int | None
    status: str = HELD


class ReservationMachine(RuleBasedStateMachine):
    """Workers of several epochs reserve and finish stock; any lease ever issued may come back late."""

    def __init__(self, inventory: Inventory, coordinator: LeaseManager, amnesiac: LeaseManager) -> None:
        super().__init__()
        self.inventory = inventory
        self.coordinator = coordinator
        # A second lease store that knows nothing of the first: it hands out token numbers the real
        # coordinator already issued, like a coordinator that lost its counter. Only the lease id in
        # the fence tells such a duplicate token apart from the epoch that wrote with it.
        self.amnesiac = amnesiac
        # The database outlives the example: fresh names keep one example's rows out of the next.
        self.run = uuid.uuid4().hex[:10]
        self.keys = itertools.count()
        self.skus: dict[str, SkuModel] = {}
        self.reservations: dict[str, ReservationModel] = {}
        self.stored: dict[str, tuple[Request, Outcome | Refusal]] = {}
        self.unsettled: list[tuple[Request, str | None]] = []  # refused before anything was stored
        self.lost: set[str] = set()  # lease ids the library must treat as lost from now on
        self.touched: set[str] = set()  # SKUs whose rows the next invariant check reads back

    # -- setup and lease epochs --------------------------------------------------------------------

    @initialize(stock=st.lists(st.integers(0, 10), min_size=2, max_size=3))
    def create_skus(self, stock: list[int]) -> None:
        for index, on_hand in enumerate(stock):
            self.add_sku(f"{self.run}-{index}", on_hand)

    def add_sku(self, name: str, on_hand: int) -> SkuModel:
        agree(
            f"add {name}",
            self.inventory.add_sku(name, on_hand=on_hand),
            StockLevel(name, on_hand, 0, on_hand, 0),
        )
        lease = self.coordinator.acquire(scope_of(name), ttl=TTL, holder="worker-1")
        model = SkuModel(name, on_hand, live=lease, leases=[lease])
        self.skus[name] = model
        return model

    @rule(data=st.data())
    def new_epoch(self, data: st.DataObject) -> None:
        model = self.skus[self.draw_sku(data)]
        scope = scope_of(model.name)
        # The old holder is told nothing, like a worker paused past its ttl: its Lease stays usable.
        broken = self.coordinator.break_lease(scope, reason="property test: new epoch")
        agree(f"{scope}: broken token", None if broken is None else broken.token, model.live.token)
        lease = self.coordinator.acquire(scope, ttl=TTL, holder=f"worker-{len(model.leases) + 1}")
        agree(f"{scope}: new token", lease.token, model.live.token + 1)
        model.live = lease
        model.leases.append(lease)

    @precondition(lambda self: any(m.amnesiac_issued < m.live.token for m in self.skus.values()))
    @rule(data=st.data())
    def amnesiac_epoch(self, data: st.DataObject) -> None:
        names = [name for name, m in self.skus.items() if m.amnesiac_issued < m.live.token]
        self.duplicate_lease(data.draw(st.sampled_from(names)))

    def duplicate_lease(self, sku: str) -> Lease:
        """A lease whose token the real coordinator has already issued (never a newer one)."""
        model = self.skus[sku]
        self.amnesiac.break_lease(scope_of(sku), reason="property test: amnesiac epoch")
        lease = self.amnesiac.acquire(scope_of(sku), ttl=TTL, holder="amnesiac")
        agree(f"{sku}: amnesiac token", lease.token, model.amnesiac_issued + 1)
        model.amnesiac_issued = lease.token
        model.leases.append(lease)
        return lease

    # -- operations --------------------------------------------------------------------------------

    @rule(data=st.data(), quantity=st.integers(1, 6), hold=HOLDS)
    def reserve(self, data: st.DataObject, quantity: int, hold: int | None) -> None:
        sku = self.draw_sku(data)
        request = Request("reserve", sku=sku, quantity=quantity, hold_ms=hold)
        self.submit(request, self.new_key(), {sku: self.draw_lease(data, sku)})

    @rule(data=st.data(), hold=HOLDS)
    def reserve_many(self, data: st.DataObject, hold: int | None) -> None:
        names = data.draw(st.lists(st.sampled_from(list(self.skus)), min_size=1, unique=True), label="skus")
        lines = [(name, data.draw(st.integers(1, 5), label=f"units of {name}")) for name in names]
        leases = {name: self.draw_lease(data, name) for name in names}
        # Lines go in as drawn; the request (and the fingerprint) sees them sorted.
        self.submit(
            Request("reserve_many", hold_ms=hold, lines=tuple(sorted(lines))), self.new_key(), leases, lines
        )

    @rule(data=st.data(), quantity=st.integers(1, 5))
    def restock(self, data: st.DataObject, quantity: int) -> None:
        sku = self.draw_sku(data)
        self.submit(
            Request("restock", sku=sku, quantity=quantity), self.new_key(), {sku: self.draw_lease(data, sku)}
        )

    @rule(
        data=st.data(),
        delta=st.integers(-6, 6).filter(bool),
        reason=st.sampled_from([None, "cycle count"]),
    )
    def adjust(self, data: st.DataObject, delta: int, reason: str | None) -> None:
        sku = self.draw_sku(data)
        request = Request("adjust", sku=sku, quantity=delta, reason=reason)
        self.submit(request, self.new_key(), {sku: self.draw_lease(data, sku)})

    @precondition(lambda self: self.reservations)
    @rule(data=st.data(), op=st.sampled_from(["confirm", "release"]))
    def finish(self, data: st.DataObject, op: str) -> None:
        reservation = self.draw_reservation(data)
        lease = self.draw_lease(data, reservation.sku)
        self.submit(Request(op, reservation_id=reservation.id), self.new_key(), {reservation.sku: lease})

    @precondition(lambda self: self.reservations)
    @rule(data=st.data(), op=st.sampled_from(["confirm", "release"]))
    def finish_with_another_skus_lease(self, data: st.DataObject, op: str) -> None:
        reservation = self.draw_reservation(data)
        other = data.draw(st.sampled_from([name for name in self.skus if name != reservation.sku]))
        lease = self.draw_lease(data, other)
        self.submit(Request(op, reservation_id=reservation.id), self.new_key(), {reservation.sku: lease})

    @rule(data=st.data(), keyed=st.booleans())
    def expire(self, data: st.DataObject, keyed: bool) -> None:
        sku = self.draw_sku(data)
        key = self.new_key() if keyed else None
        self.submit(Request("expire", sku=sku), key, {sku: self.draw_lease(data, sku)})

    @precondition(lambda self: self.stored)
    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        # A redelivered task: same key, same request, any lease it may hold by now (even a lost one).
        key = data.draw(st.sampled_from(list(self.stored)), label="key")
        request, _ = self.stored[key]
        lines = data.draw(st.permutations(request.lines), label="line order")
        self.submit(request, key, self.draw_leases(data, request), lines)

    @precondition(lambda self: self.stored)
    @rule(data=st.data())
    def reuse_key(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(list(self.stored)), label="key")
        request = data.draw(st.sampled_from(self.variants(self.stored[key][0])), label="different request")
        self.submit(request, key, self.draw_leases(data, request))

    @precondition(lambda self: self.unsettled)
    @rule(data=st.data())
    def retry_with_live_leases(self, data: st.DataObject) -> None:
        # A refused stale or lost write stored nothing under its key: the new epoch may retry it.
        request, key = data.draw(st.sampled_from(self.unsettled), label="unsettled request")
        self.submit(request, key, {sku: self.skus[sku].live for sku in self.skus_of(request)})

    # -- invariants --------------------------------------------------------------------------------

    @invariant()
    def database_agrees_with_model(self) -> None:
        levels = {level.sku: level for level in self.inventory.all_stock() if level.sku in self.skus}
        agree("stock", levels, {name: m.level for name, m in self.skus.items()})
        agree("invariant violations", self.inventory.invariant_violations(), [])
        counts = {sku: n for sku, n in self.inventory.rejection_counts().items() if sku in self.skus}
        agree(
            "rejection counts", counts, {name: len(m.rejected) for name, m in self.skus.items() if m.rejected}
        )
        # Reservations and history are read back only for the SKUs the step addressed: the checks
        # above already cover every SKU's stock, and they are most of each step's cost.
        for name in sorted(self.touched):
            self.check_rows(name)
        self.touched.clear()

    def check_rows(self, name: str) -> None:
        model = self.skus[name]
        views = self.inventory.reservations(name, limit=1000)
        seen = {view.id: (view.status, view.quantity, view.hold_expires_at is None) for view in views}
        want = {
            r.id: (r.status, r.quantity, r.hold_ms is None)
            for r in self.reservations.values()
            if r.sku == name
        }
        agree(f"{name}: reservations", seen, want)
        for view in views:
            # On PostgreSQL created_ms and hold_expires_ms are two reads of clock_timestamp() in one
            # INSERT, so the stored hold can be 1 ms off the one asked for; more is a real mismatch.
            if view.hold_expires_at is not None:
                held_ms = round((view.hold_expires_at - view.created_at) * 1000)
                asked = self.reservations[view.id].hold_ms or 0
                if abs(held_ms - asked) > 1:
                    raise ModelMismatch(f"{view}: held for {held_ms} ms, model expects {asked} ms")
        history = self.inventory.history(name)
        refused = [(entry.token, entry.highest_token) for entry in history if entry.kind == "rejected"]
        agree(f"{name}: rejected writes in history", refused, model.rejected)
        agree(f"{name}: accepted writes in history", sum(e.kind == "write" for e in history), model.writes)

    @invariant()
    def lost_leases_are_sticky(self) -> None:
        for model in self.skus.values():
            for lease in model.leases:
                agree(f"{model.name}: token {lease.token} lost", lease.lost, lease.lease_id in self.lost)

    # -- the model ---------------------------------------------------------------------------------

    def submit(
        self,
        request: Request,
        key: str | None,
        leases: Mapping[str, Lease],
        lines: Sequence[tuple[str, int]] | None = None,
    ) -> None:
        """Predict, run, judge, then move the model: the one path every rule goes through."""
        if request.op == "expire":
            self.wait_until_tiny_holds_are_due(request.sku or "")
        verdict = self.predict(request, key, leases)
        self.touched.update(
            self.skus_of(request), (lease.scope.removeprefix("sku:") for lease in leases.values())
        )
        got: Outcome | Exception
        try:
            got = self.call(request, key, leases, lines)
        except (ReservationError, LostOwnership) as exc:  # anything else is a failure of its own
            got = exc
        self.settle(request, key, leases, verdict, got)

    def predict(self, request: Request, key: str | None, leases: Mapping[str, Lease]) -> Verdict:
        # The key is looked up before anything else, the lease included: a stored outcome is final.
        if key is not None and key in self.stored:
            stored_request, stored = self.stored[key]
            return Verdict("replay", stored=stored) if stored_request == request else Verdict("conflict")
        if request.op in ("confirm", "release"):
            reservation = self.reservations[request.reservation_id or ""]
            lease = leases[reservation.sku]
            if lease.scope != scope_of(reservation.sku) or reservation.status != HELD:
                return Verdict("invalid")
            return self.gate(reservation.sku, lease, None) or Verdict("apply")
        if request.op == "expire":
            sku = request.sku or ""
            lease = leases[sku]
            if not self.due(sku):
                # Nothing to write, so the fence is never asked; only a lease known lost is refused.
                return (
                    Verdict("lost", sku=sku, lease=lease) if lease.lease_id in self.lost else Verdict("apply")
                )
            return self.gate(sku, lease, None) or Verdict("apply")
        if request.op == "reserve_many":
            # Lines are written in SKU order inside one transaction; the first refusal decides.
            for sku, quantity in request.lines:
                blocked = self.gate(sku, leases[sku], quantity)
                if blocked is not None:
                    return blocked
            return Verdict("apply")
        sku = request.sku or ""
        # restock and a positive adjust carry no condition; the others need that many units available
        need = request.quantity if request.op == "reserve" else -request.quantity
        return self.gate(sku, leases[sku], need if need > 0 else None) or Verdict("apply")

    def gate(self, sku: str, lease: Lease, need: int | None) -> Verdict | None:
        """The fenced UPDATE's decision: sticky loss first, then the fence, then the write's condition."""
        model = self.skus[sku]
        if lease.lease_id in self.lost:
            return Verdict("lost", sku=sku, lease=lease)
        if not model.accepts(lease):
            return Verdict("stale", sku=sku, lease=lease)
        if need is not None and model.available < need:
            return Verdict("insufficient", refusal=Refusal(sku, need, model.available))
        return None

    def call(
        self,
        request: Request,
        key: str | None,
        leases: Mapping[str, Lease],
        lines: Sequence[tuple[str, int]] | None,
    ) -> Outcome:
        inv, sku = self.inventory, request.sku or ""
        hold = None if request.hold_ms is None else request.hold_ms / 1000
        match request.op:
            case "reserve":
                return inv.reserve(leases[sku], sku, request.quantity, key=_key(key), hold_for=hold)
            case "reserve_many":
                order = list(request.lines if lines is None else lines)
                return inv.reserve_many(leases, order, key=_key(key), hold_for=hold)
            case "restock":
                return inv.restock(leases[sku], sku, request.quantity, key=_key(key))
            case "adjust":
                return inv.adjust(leases[sku], sku, request.quantity, key=_key(key), reason=request.reason)
            case "confirm" | "release":
                reservation_id = request.reservation_id or ""
                lease = leases[self.reservations[reservation_id].sku]
                finish = inv.confirm if request.op == "confirm" else inv.release
                return finish(lease, reservation_id, key=_key(key))
            case "expire":
                return inv.expire_due(leases[sku], sku, key=key)
        raise AssertionError(f"unknown operation {request.op}")  # pragma: no cover

    def settle(
        self,
        request: Request,
        key: str | None,
        leases: Mapping[str, Lease],
        verdict: Verdict,
        got: Outcome | Exception,
    ) -> None:
        what = f"{request} with key {key}"
        match verdict.kind:
            case "replay" if isinstance(verdict.stored, Refusal):
                self.check_refusal(what, got, verdict.stored, replayed=True)
            case "replay":
                assert isinstance(verdict.stored, Outcome)
                agree(what, got, dataclasses.replace(verdict.stored, replayed=True))
            case "conflict":
                expect_error(what, got, IdempotencyConflict)
            case "invalid":
                expect_error(what, got, InvalidTransition)
            case "lost":
                expect_error(what, got, LeaseLost)
            case "stale":
                assert verdict.sku is not None and verdict.lease is not None
                model = self.skus[verdict.sku]
                error = expect_error(what, got, StaleToken)
                agree(
                    f"{what}: stale tokens",
                    (error.presented, error.highest),
                    (verdict.lease.token, model.fence[0]),
                )
                model.rejected.append((verdict.lease.token, model.fence[0]))
                self.lost.add(verdict.lease.lease_id)
            case "insufficient":
                assert verdict.refusal is not None
                self.check_refusal(what, got, verdict.refusal, replayed=False)
                if key is not None:
                    self.stored[key] = (request, verdict.refusal)
            case "apply":
                if not isinstance(got, Outcome):
                    raise ModelMismatch(f"{what}: got {got!r}, model expects it applied")
                self.apply(what, request, key, leases, got)
        if verdict.kind in ("stale", "lost", "invalid") and (request, key) not in self.unsettled:
            self.unsettled.append((request, key))

    def check_refusal(self, what: str, got: object, refusal: Refusal, *, replayed: bool) -> None:
        error = expect_error(what, got, InsufficientStock)
        agree(f"{what}: refusal", (error.sku, error.requested, error.available), dataclasses.astuple(refusal))
        agree(f"{what}: refusal replayed", error.replayed, replayed)

    def apply(
        self, what: str, request: Request, key: str | None, leases: Mapping[str, Lease], outcome: Outcome
    ) -> None:
        ids = outcome.reservation_ids
        token: int | None
        match request.op:
            case "reserve" | "reserve_many":
                lines = request.lines or ((request.sku or "", request.quantity),)
                agree(f"{what}: reservations made", len(ids), len(lines))
                for (sku, quantity), reservation_id in zip(lines, ids, strict=True):
                    self.skus[sku].reserved += quantity
                    self.write(sku, leases[sku])
                    self.reservations[reservation_id] = ReservationModel(
                        reservation_id, sku, quantity, request.hold_ms
                    )
                skus = [sku for sku, _ in lines]
                token = None if request.op == "reserve_many" else leases[skus[0]].token
                quantity = sum(q for _, q in lines)
            case "restock" | "adjust":
                skus = [request.sku or ""]
                self.skus[skus[0]].on_hand += request.quantity
                self.write(skus[0], leases[skus[0]])
                token, quantity = leases[skus[0]].token, request.quantity
            case "confirm" | "release":
                reservation = self.reservations[request.reservation_id or ""]
                skus = [reservation.sku]
                model = self.skus[reservation.sku]
                model.reserved -= reservation.quantity
                if request.op == "confirm":
                    model.on_hand -= reservation.quantity
                reservation.status = CONFIRMED if request.op == "confirm" else RELEASED
                self.write(reservation.sku, leases[reservation.sku])
                token, quantity = leases[reservation.sku].token, reservation.quantity
            case _:  # expire
                skus = [request.sku or ""]
                due = self.due(skus[0])
                agree(f"{what}: expired", sorted(ids), sorted(r.id for r in due))
                for reservation in due:
                    reservation.status = EXPIRED
                    self.skus[skus[0]].reserved -= reservation.quantity
                if due:
                    self.write(skus[0], leases[skus[0]], rows=len(due))
                token, quantity = leases[skus[0]].token, sum(r.quantity for r in due)
        operation = "expire" if request.op == "expire" else request.op
        levels = tuple(self.skus[sku].level for sku in skus)
        agree(what, outcome, Outcome(operation, key, token, ids, levels, quantity))
        if key is not None:
            self.stored[key] = (request, outcome)

    def write(self, sku: str, lease: Lease, rows: int = 1) -> None:
        model = self.skus[sku]
        model.fence = (lease.token, lease.lease_id)
        model.writes += rows

    def due(self, sku: str) -> list[ReservationModel]:
        return [
            r
            for r in self.reservations.values()
            if r.sku == sku and r.status == HELD and r.hold_ms == TINY_HOLD_MS
        ]

    def wait_until_tiny_holds_are_due(self, sku: str) -> None:
        """Poll the database clock (never a fixed sleep) until every 1 ms hold on ``sku`` has passed."""
        tiny = {r.id for r in self.due(sku)}
        if not tiny:
            return
        views = self.inventory.reservations(sku, status=HELD, limit=1000)
        until = max((round((v.hold_expires_at or 0) * 1000) for v in views if v.id in tiny), default=0)
        deadline = time.monotonic() + CLOCK_WAIT
        with self.inventory.executor.engine.connect() as conn:
            while conn.execute(sa.select(db_now_ms())).scalar_one() < until:
                if time.monotonic() > deadline:
                    raise AssertionError(f"database clock did not reach {until} within {CLOCK_WAIT}s")
                conn.rollback()  # end the read transaction so SQLite's writer lock is not held

    # -- drawing -----------------------------------------------------------------------------------

    def new_key(self) -> str:
        return f"{self.run}-k{next(self.keys)}"

    def draw_sku(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(list(self.skus)), label="sku")

    def draw_lease(self, data: st.DataObject, sku: str) -> Lease:
        # Half the time the live lease; otherwise any epoch ever issued, as a late or paused worker.
        model = self.skus[sku]
        return data.draw(
            st.one_of(st.just(model.live), st.sampled_from(model.leases)), label=f"lease of {sku}"
        )

    def draw_leases(self, data: st.DataObject, request: Request) -> dict[str, Lease]:
        return {sku: self.draw_lease(data, sku) for sku in self.skus_of(request)}

    def draw_reservation(self, data: st.DataObject) -> ReservationModel:
        held = [r for r in self.reservations.values() if r.status == HELD]
        pick = st.sampled_from(list(self.reservations.values()))
        return data.draw(st.one_of(st.sampled_from(held), pick) if held else pick, label="reservation")

    def skus_of(self, request: Request) -> list[str]:
        if request.lines:
            return [sku for sku, _ in request.lines]
        if request.reservation_id is not None:
            return [self.reservations[request.reservation_id].sku]
        return [request.sku or ""]

    def variants(self, request: Request) -> list[Request]:
        """Valid requests that differ from ``request`` in something its fingerprint covers."""
        first = self.skus_of(request)[0]
        step = 1 if request.quantity >= 0 else -1
        found = [Request("restock", sku=first, quantity=1), Request("expire", sku=first)]
        match request.op:
            case "reserve" | "restock" | "adjust":
                found.append(dataclasses.replace(request, quantity=request.quantity + step))
                if request.quantity > 0:
                    found.append(
                        dataclasses.replace(request, op="adjust" if request.op == "restock" else "restock")
                    )
            case "reserve_many":
                (sku, units), *rest = request.lines
                found.append(dataclasses.replace(request, lines=((sku, units + 1), *rest)))
                found.append(dataclasses.replace(request, hold_ms=None if request.hold_ms else TINY_HOLD_MS))
            case "confirm" | "release":
                found.append(
                    dataclasses.replace(request, op="release" if request.op == "confirm" else "confirm")
                )
        return [other for other in found if other != request]


def _key(key: str | None) -> str:
    assert key is not None, "only expire_due runs without a key"
    return key


def bind(inventory: Inventory, coordinator: LeaseManager, amnesiac: LeaseManager) -> type[ReservationMachine]:
    """The machine class Hypothesis instantiates, closed over this test's inventory and coordinators."""

    class Bound(ReservationMachine):
        def __init__(self) -> None:
            super().__init__(inventory, coordinator, amnesiac)

    return Bound


@contextmanager
def amnesiac_coordinator(tmp_path: Path) -> Iterator[LeaseManager]:
    with LeaseManager.from_url(f"sqlite:///{tmp_path / 'amnesiac-leases.sqlite3'}") as manager:
        manager.create_schema()
        yield manager


def test_reservation_lifecycle_matches_model(
    inventory_url: str, leases: LeaseManager, tmp_path: Path
) -> None:
    with Inventory.from_url(inventory_url) as inventory, amnesiac_coordinator(tmp_path) as amnesiac:
        run_state_machine_as_test(bind(inventory, leases, amnesiac), settings=SETTINGS)


def write_with_a_duplicate_token(
    inventory: Inventory, coordinator: LeaseManager, amnesiac: LeaseManager
) -> None:
    """The live epoch writes; then a lease with the same token but another lease id writes too."""
    machine = ReservationMachine(inventory, coordinator, amnesiac)
    model = machine.add_sku(f"{machine.run}-0", 5)
    machine.submit(
        Request("reserve", sku=model.name, quantity=2), machine.new_key(), {model.name: model.live}
    )
    duplicate = machine.duplicate_lease(model.name)
    assert duplicate.token == model.live.token
    machine.submit(Request("restock", sku=model.name, quantity=1), machine.new_key(), {model.name: duplicate})
    machine.database_agrees_with_model()


@pytest.mark.parametrize("inventory_url", ["sqlite"], indirect=True)
def test_model_catches_a_stale_write_when_the_fence_is_off(
    inventory_url: str, leases: LeaseManager, tmp_path: Path
) -> None:
    # A lower token is stopped even without the fence (a trigger keeps fence_token from going back),
    # so the stale write here carries a duplicate token, which only the fence's lease id check refuses.
    with amnesiac_coordinator(tmp_path) as amnesiac:
        with Inventory.from_url(inventory_url) as fenced:
            write_with_a_duplicate_token(fenced, leases, amnesiac)  # refused, as the model predicts
        # "got Outcome": the restock was applied where the model expected StaleToken.
        applied = r"got Outcome\(operation='restock'.*model expects StaleToken"
        with (
            Inventory.from_url(inventory_url, enforce_fence=False) as unfenced,
            pytest.raises(ModelMismatch, match=applied),
        ):
            write_with_a_duplicate_token(unfenced, leases, amnesiac)
