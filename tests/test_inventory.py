"""Every inventory operation on SQLite and PostgreSQL: its effect, its idempotent replay, its fenced
rejection (recorded durably, nothing changed), and the typed refusal of bad input.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from fencing import Lease, LeaseLost, LeaseManager, ScopeMismatch, StaleToken
from fencing.engines import make_engine
from reservations import (
    AsyncInventory,
    IdempotencyConflict,
    InsufficientStock,
    InvalidRequest,
    InvalidTransition,
    Inventory,
    Outcome,
    StockLimitExceeded,
    UnknownReservation,
    UnknownSku,
    schema,
    scope_of,
)
from reservations.lifecycle import expire_due
from reservations.models import reservations, sku_history, stock
from reservations.validation import MAX_ON_HAND
from testing.stock import lease_for, level, snapshot
from testing.stores import own_pg_schema


@pytest.fixture
def widget(inventory: Inventory) -> str:
    inventory.add_sku("WIDGET", on_hand=10)
    return "WIDGET"


# -- effects --------------------------------------------------------------------------------------


def test_reserve_confirm_release_move_units(inventory: Inventory, leases: LeaseManager, widget: str) -> None:
    lease = lease_for(leases, widget)
    first = inventory.reserve(lease, widget, 3, key="order-1")
    assert level(inventory, widget) == (10, 3, 7)
    second = inventory.reserve(lease, widget, 2, key="order-2")
    assert level(inventory, widget) == (10, 5, 5)
    inventory.confirm(lease, first.reservation_id or "", key="confirm-1")
    assert level(inventory, widget) == (7, 2, 5)
    inventory.release(lease, second.reservation_id or "", key="release-2")
    assert level(inventory, widget) == (7, 0, 7)
    assert inventory.reservation(first.reservation_id or "").status == "confirmed"
    assert inventory.reservation("order-2").status == "released"  # looked up by its key
    assert inventory.invariant_violations() == []


def test_restock_and_adjust_change_on_hand(inventory: Inventory, leases: LeaseManager, widget: str) -> None:
    lease = lease_for(leases, widget)
    inventory.restock(lease, widget, 5, key="rs-1")
    assert level(inventory, widget) == (15, 0, 15)
    inventory.adjust(lease, widget, -4, key="adj-1", reason="cycle count")
    assert level(inventory, widget) == (11, 0, 11)
    with pytest.raises(InsufficientStock):
        inventory.adjust(lease, widget, -12, key="adj-2")
    assert level(inventory, widget) == (11, 0, 11)


def test_insufficient_stock_is_typed_and_changes_nothing(
    inventory: Inventory, leases: LeaseManager, widget: str, inventory_url: str
) -> None:
    lease = lease_for(leases, widget)
    before = snapshot(inventory_url)
    with pytest.raises(InsufficientStock) as short:
        inventory.reserve(lease, widget, 11, key="big")
    assert (short.value.sku, short.value.requested, short.value.available) == (widget, 11, 10)
    after = snapshot(inventory_url)
    assert after["stock"] == before["stock"] and after["reservations"] == before["reservations"]
    assert not lease.lost


def seed_on_hand(inventory_url: str, sku: str, on_hand: int) -> None:
    """Setup: a SKU whose stock grew over years of restocks, recorded as one adjustment in its history."""
    engine = make_engine(inventory_url)
    with engine.begin() as conn:
        added = on_hand - conn.execute(sa.select(stock.c.on_hand).where(stock.c.sku == sku)).scalar_one()
        conn.execute(
            sa.update(stock)
            .where(stock.c.sku == sku)
            .values(on_hand=stock.c.on_hand + added, available=stock.c.available + added)
        )
        conn.execute(
            sa.insert(sku_history).values(
                sku=sku,
                at_ms=int(time.time() * 1000),
                kind="write",
                operation="adjust",
                token=0,
                quantity=added,
                on_hand_delta=added,
                reserved_delta=0,
            )
        )
    engine.dispose()


def test_stock_past_its_bound_is_typed_and_changes_nothing(
    inventory: Inventory, leases: LeaseManager, widget: str, inventory_url: str
) -> None:
    lease = lease_for(leases, widget)
    seed_on_hand(inventory_url, widget, MAX_ON_HAND - 15)
    inventory.restock(lease, widget, 10, key="near")
    assert level(inventory, widget) == (MAX_ON_HAND - 5, 0, MAX_ON_HAND - 5)
    before, entries = snapshot(inventory_url), len(inventory.history(widget))
    for attempt in (
        lambda: inventory.restock(lease, widget, 6, key="past"),
        lambda: inventory.adjust(lease, widget, 6, key="past-adjust", reason="cycle count"),
    ):
        with pytest.raises(StockLimitExceeded) as refused:
            attempt()
        assert isinstance(refused.value, InvalidRequest)
        assert (refused.value.sku, refused.value.on_hand, refused.value.delta) == (widget, MAX_ON_HAND - 5, 6)
        assert refused.value.limit == MAX_ON_HAND
    assert snapshot(inventory_url) == before and len(inventory.history(widget)) == entries
    assert inventory.request_outcome("past") is None and not lease.lost
    inventory.restock(lease, widget, 5, key="to-the-bound")  # exactly the bound is allowed
    with pytest.raises(StockLimitExceeded):
        inventory.restock(lease, widget, 1, key="one-more")
    inventory.adjust(lease, widget, -1, key="shrink")  # taking units away needs no headroom
    inventory.reserve(lease, widget, 1, key="held")
    assert level(inventory, widget) == (MAX_ON_HAND - 1, 1, MAX_ON_HAND - 2)
    assert inventory.invariant_violations() == []


def test_expire_due_returns_only_expired_holds(
    inventory: Inventory, leases: LeaseManager, widget: str
) -> None:
    lease = lease_for(leases, widget)
    short = inventory.reserve(lease, widget, 2, key="short", hold_for=0.05)
    inventory.reserve(lease, widget, 3, key="long", hold_for=3600)
    inventory.reserve(lease, widget, 1, key="forever")
    deadline = time.monotonic() + 5
    expired: Outcome | None = None
    while time.monotonic() < deadline:  # the hold ends by the database's clock; poll until it has
        expired = inventory.expire_due(lease, widget)
        if expired.reservation_ids:
            break
    assert expired is not None and expired.reservation_ids == short.reservation_ids
    assert level(inventory, widget) == (10, 4, 6)
    assert inventory.reservation("short").status == "expired"
    with pytest.raises(InvalidTransition):
        inventory.confirm(lease, short.reservation_id or "", key="too-late")
    assert inventory.invariant_violations() == []


def test_reserve_many_is_all_or_nothing(inventory: Inventory, leases: LeaseManager) -> None:
    for sku, units in (("A-1", 5), ("B-2", 1), ("C-3", 5)):
        inventory.add_sku(sku, on_hand=units)
    with inventory.hold_many(leases, ["C-3", "A-1", "B-2"], ttl=30) as held:
        assert list(held) == ["A-1", "B-2", "C-3"]  # lock order: sorted
        with pytest.raises(InsufficientStock) as short:
            inventory.reserve_many(held, [("C-3", 2), ("A-1", 2), ("B-2", 2)], key="order-9")
        assert short.value.sku == "B-2"
        assert [level(inventory, s) for s in ("A-1", "B-2", "C-3")] == [(5, 0, 5), (1, 0, 1), (5, 0, 5)]
        done = inventory.reserve_many(held, [("C-3", 2), ("A-1", 2)], key="order-10")
    assert len(done.reservation_ids) == 2
    assert [level(inventory, s) for s in ("A-1", "C-3")] == [(5, 2, 3), (5, 2, 3)]
    assert {r.sku for r in inventory.reservations(order_key="order-10")} == {"A-1", "C-3"}
    assert inventory.invariant_violations() == []


# -- idempotent replays ---------------------------------------------------------------------------

OPERATIONS: dict[str, Callable[[Inventory, Lease, str], Outcome]] = {
    "reserve": lambda inv, lease, key: inv.reserve(lease, "WIDGET", 2, key=key),
    "restock": lambda inv, lease, key: inv.restock(lease, "WIDGET", 2, key=key),
    "adjust": lambda inv, lease, key: inv.adjust(lease, "WIDGET", -2, key=key),
    "confirm": lambda inv, lease, key: inv.confirm(lease, inv.reservation("held-1").id, key=key),
    "release": lambda inv, lease, key: inv.release(lease, inv.reservation("held-1").id, key=key),
    "reserve_many": lambda inv, lease, key: inv.reserve_many({"WIDGET": lease}, [("WIDGET", 1)], key=key),
}


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_replay_returns_the_stored_outcome_and_changes_nothing(
    inventory: Inventory, leases: LeaseManager, widget: str, inventory_url: str, operation: str
) -> None:
    lease = lease_for(leases, widget)
    inventory.reserve(lease, widget, 1, key="held-1")
    first = OPERATIONS[operation](inventory, lease, "the-key")
    before = snapshot(inventory_url)
    again = OPERATIONS[operation](inventory, lease, "the-key")
    assert again.replayed and not first.replayed
    assert (again.reservation_ids, again.stock, again.token) == (
        first.reservation_ids,
        first.stock,
        first.token,
    )
    assert snapshot(inventory_url) == before


def test_replay_after_a_lost_reply_does_not_apply_twice(
    inventory: Inventory, leases: LeaseManager, widget: str
) -> None:
    """The first attempt committed but its caller never saw the reply; a new epoch retries the key."""
    first = lease_for(leases, widget, holder="A")
    inventory.reserve(first, widget, 4, key="lost-reply")
    leases.break_lease(scope_of(widget), reason="A crashed before acknowledging")
    second = lease_for(leases, widget, holder="B")
    again = inventory.reserve(second, widget, 4, key="lost-reply")
    assert again.replayed and again.token == first.token
    assert level(inventory, widget) == (10, 4, 6)
    assert len(inventory.reservations(widget)) == 1


def test_stored_insufficient_outcome_replays(inventory: Inventory, leases: LeaseManager, widget: str) -> None:
    lease = lease_for(leases, widget)
    with pytest.raises(InsufficientStock) as first:
        inventory.reserve(lease, widget, 50, key="too-many")
    inventory.restock(lease, widget, 100, key="rs")
    with pytest.raises(InsufficientStock) as again:
        inventory.reserve(lease, widget, 50, key="too-many")
    assert not first.value.replayed and again.value.replayed
    assert again.value.available == 10  # the outcome as it was decided, not re-evaluated


def test_same_key_for_a_different_request_is_a_conflict(
    inventory: Inventory, leases: LeaseManager, widget: str, inventory_url: str
) -> None:
    lease = lease_for(leases, widget)
    inventory.reserve(lease, widget, 2, key="k")
    before = snapshot(inventory_url)
    for attempt in (
        lambda: inventory.reserve(lease, widget, 3, key="k"),
        lambda: inventory.reserve(lease, widget, 2, key="k", hold_for=60),
        lambda: inventory.restock(lease, widget, 2, key="k"),
    ):
        with pytest.raises(IdempotencyConflict) as conflict:
            attempt()
        assert conflict.value.key == "k"
    assert snapshot(inventory_url) == before


# -- fenced rejections ----------------------------------------------------------------------------

STALE_WRITES: dict[str, Callable[[Inventory, Lease], Outcome]] = {
    "reserve": lambda inv, lease: inv.reserve(lease, "WIDGET", 1, key="stale-op"),
    "restock": lambda inv, lease: inv.restock(lease, "WIDGET", 1, key="stale-op"),
    "adjust": lambda inv, lease: inv.adjust(lease, "WIDGET", -1, key="stale-op"),
    "confirm": lambda inv, lease: inv.confirm(lease, inv.reservation("held-1").id, key="stale-op"),
    "release": lambda inv, lease: inv.release(lease, inv.reservation("held-1").id, key="stale-op"),
    "expire": lambda inv, lease: inv.expire_due(lease, "WIDGET", key="stale-op"),
    "reserve_many": lambda inv, lease: inv.reserve_many({"WIDGET": lease}, [("WIDGET", 1)], key="stale-op"),
}


@pytest.mark.parametrize("operation", sorted(STALE_WRITES))
def test_stale_epoch_is_rejected_recorded_and_changes_nothing(
    inventory: Inventory, leases: LeaseManager, widget: str, inventory_url: str, operation: str
) -> None:
    old = lease_for(leases, widget, holder="A")
    inventory.reserve(old, widget, 1, key="held-1", hold_for=0.001)
    leases.break_lease(scope_of(widget), reason="A paused past its lease")
    new = lease_for(leases, widget, holder="B")
    inventory.restock(new, widget, 1, key="b-writes")
    before = snapshot(inventory_url)
    with pytest.raises(StaleToken) as stale:
        STALE_WRITES[operation](inventory, old)
    assert (stale.value.presented, stale.value.highest) == (old.token, new.token)
    assert snapshot(inventory_url) == before
    assert inventory.rejection_counts() == {widget: 1}
    rejected = [h for h in inventory.history(widget) if h.kind == "rejected"]
    assert [(h.token, h.highest_token, h.holder, h.operation) for h in rejected] == [
        (old.token, new.token, "A", "expire" if operation == "expire" else operation)
    ]
    with pytest.raises(LeaseLost):  # sticky: refused without asking the database again
        STALE_WRITES[operation](inventory, old)
    assert inventory.rejection_counts() == {widget: 1}


def test_fence_trigger_refuses_lowering_the_token(
    inventory: Inventory, leases: LeaseManager, widget: str, inventory_url: str
) -> None:
    """A code path that forgets the guard still cannot move the fence backwards."""
    inventory.restock(lease_for(leases, widget), widget, 1, key="rs")
    engine = make_engine(inventory_url)
    with pytest.raises(IntegrityError), engine.begin() as conn:
        conn.execute(sa.update(stock).where(stock.c.sku == widget).values(fence_token=0))
    engine.dispose()
    assert inventory.stock(widget).fence_token >= 1


def test_database_holds_the_invariants(
    inventory: Inventory, leases: LeaseManager, widget: str, inventory_url: str
) -> None:
    lease = lease_for(leases, widget)
    done = inventory.reserve(lease, widget, 2, key="r")
    inventory.confirm(lease, done.reservation_id or "", key="c")
    engine = make_engine(inventory_url)
    breaking = [
        sa.update(stock).where(stock.c.sku == widget).values(available=stock.c.available - 1),  # conservation
        sa.update(stock).where(stock.c.sku == widget).values(available=-1, on_hand=-1),  # negative
        sa.update(reservations).values(status="held"),  # a final reservation changes again
        sa.insert(reservations).values(  # units held without being taken from the stock row
            id="r_rogue",
            sku=widget,
            quantity=1,
            status="held",
            idempotency_key="rogue",
            token=1,
            lease_id="rogue",
            created_ms=0,
        ),
        sa.delete(sku_history),  # history is append-only
    ]
    for statement in breaking:
        with pytest.raises(IntegrityError), engine.begin() as conn:
            conn.execute(statement)
    engine.dispose()
    assert inventory.invariant_violations() == []


# -- bad input ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Refusing:
    """WIDGET (10 on hand) and a lease on it, in a database the tests of refused input share: each of
    them proves it changed nothing, so none sees another's."""

    inventory: Inventory
    lease: Lease
    url: str


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def refusing(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Refusing]:
    with ExitStack() as stack:
        if request.param == "postgresql":
            url = stack.enter_context(own_pg_schema())
        else:
            url = f"sqlite:///{tmp_path_factory.mktemp('refusing') / 'inventory.sqlite3'}"
        schema.upgrade(url)
        inventory = stack.enter_context(Inventory.from_url(url))
        leases = stack.enter_context(LeaseManager.from_url(url))
        inventory.add_sku("WIDGET", on_hand=10)
        # Valid for as long as the module runs: what is refused is the input, never the lease.
        lease = leases.acquire(scope_of("WIDGET"), ttl=3600, holder="w1")
        yield Refusing(inventory=inventory, lease=lease, url=url)


BAD_SKUS = [
    "",
    "x" * 65,
    "WID GET",
    "WID'GET",
    'W"X',
    "{WIDGET}",
    "sku:WIDGET",
    "WÎDGET",
    "'; DROP TABLE stock;--",
    "-LEADING",
    None,
    7,
]


@pytest.mark.parametrize("sku", BAD_SKUS, ids=repr)
def test_bad_sku_is_refused_and_nothing_written(refusing: Refusing, sku: Any) -> None:
    inventory, lease = refusing.inventory, refusing.lease
    before = snapshot(refusing.url)
    for attempt in (
        lambda: inventory.add_sku(sku, on_hand=1),
        lambda: inventory.reserve(lease, sku, 1, key="k"),
        lambda: inventory.restock(lease, sku, 1, key="k"),
        lambda: inventory.stock(sku),
    ):
        with pytest.raises(InvalidRequest) as refused:
            attempt()
        assert refused.value.field == "sku"
    assert snapshot(refusing.url) == before


@pytest.mark.parametrize("quantity", [0, -1, 1_000_001, 10**30, 1.5, True, "3", None], ids=repr)
def test_bad_quantity_is_refused(refusing: Refusing, quantity: Any) -> None:
    inventory, lease, widget = refusing.inventory, refusing.lease, "WIDGET"
    before = snapshot(refusing.url)
    for attempt in (
        lambda: inventory.reserve(lease, widget, quantity, key="k"),
        lambda: inventory.restock(lease, widget, quantity, key="k"),
        lambda: inventory.reserve_many({widget: lease}, [(widget, quantity)], key="k"),
    ):
        with pytest.raises(InvalidRequest):
            attempt()
    assert snapshot(refusing.url) == before


@pytest.mark.parametrize("key", ["", "has space", "k" * 201, "tab\t", "ключ", None, 5], ids=repr)
def test_bad_idempotency_key_is_refused(refusing: Refusing, key: Any) -> None:
    with pytest.raises(InvalidRequest) as refused:
        refusing.inventory.reserve(refusing.lease, "WIDGET", 1, key=key)
    assert refused.value.field == "idempotency_key"
    assert level(refusing.inventory, "WIDGET") == (10, 0, 10)


def test_unknown_sku_and_reservation(inventory: Inventory, leases: LeaseManager, widget: str) -> None:
    ghost = lease_for(leases, "GHOST")
    with pytest.raises(UnknownSku) as unknown:
        inventory.reserve(ghost, "GHOST", 1, key="k")
    assert unknown.value.sku == "GHOST"
    with pytest.raises(UnknownSku):
        inventory.stock("GHOST")
    lease = lease_for(leases, widget)
    with pytest.raises(UnknownReservation):
        inventory.confirm(lease, "r_" + "0" * 32, key="k2")
    with pytest.raises(InvalidRequest):
        inventory.confirm(lease, "not-an-id", key="k3")
    assert inventory.rejection_counts() == {}


def test_lease_of_another_sku_cannot_write(inventory: Inventory, leases: LeaseManager, widget: str) -> None:
    inventory.add_sku("GADGET", on_hand=5)
    gadget_lease = lease_for(leases, "GADGET")
    with pytest.raises(ScopeMismatch):
        inventory.reserve(gadget_lease, widget, 1, key="k")
    widget_lease = lease_for(leases, widget)
    held = inventory.reserve(widget_lease, widget, 1, key="w")
    with pytest.raises(InvalidTransition) as foreign:  # someone else's reservation
        inventory.confirm(gadget_lease, held.reservation_id or "", key="k2")
    assert "belongs to SKU WIDGET" in str(foreign.value)
    # The refusal names the reservation's SKU: a worker that took the wrong lease takes that one next.
    assert foreign.value.belongs_to == widget
    assert level(inventory, widget) == (10, 1, 9)
    assert [entry.operation for entry in inventory.history("GADGET")] == ["create"]


def test_final_reservation_cannot_be_finished_again(
    inventory: Inventory, leases: LeaseManager, widget: str
) -> None:
    lease = lease_for(leases, widget)
    held = inventory.reserve(lease, widget, 2, key="r")
    inventory.release(lease, held.reservation_id or "", key="rel")
    for attempt in (
        lambda: inventory.confirm(lease, held.reservation_id or "", key="c"),
        lambda: inventory.release(lease, held.reservation_id or "", key="rel-2"),
    ):
        with pytest.raises(InvalidTransition) as final:
            attempt()
        assert final.value.status == "released"
    assert level(inventory, widget) == (10, 0, 10)


def test_duplicate_sku_and_bad_order_lines(inventory: Inventory, leases: LeaseManager, widget: str) -> None:
    with pytest.raises(InvalidRequest):
        inventory.add_sku(widget, on_hand=1)
    lease = lease_for(leases, widget)
    for lines in ([], [(widget, 1), (widget, 2)], [(widget,)], "WIDGET", [("OTHER", 1)]):
        with pytest.raises(InvalidRequest):
            inventory.reserve_many({widget: lease}, lines, key="order")  # type: ignore[arg-type]
    assert level(inventory, widget) == (10, 0, 10)


def test_idempotency_retention_purges_only_old_records(
    inventory: Inventory, leases: LeaseManager, widget: str
) -> None:
    inventory.reserve(lease_for(leases, widget), widget, 1, key="recent")
    inventory.record_outcome("recent", "reserve", "reserved", {})
    assert inventory.purge_idempotency(older_than=3600) == 0
    assert inventory.purge_requests(older_than=3600) == 0
    assert inventory.request_outcome("recent") is not None
    with pytest.raises(InvalidRequest):
        inventory.purge_idempotency(older_than=0)
    with pytest.raises(InvalidRequest):
        inventory.purge_requests(older_than=1)


def test_history_explains_every_change(inventory: Inventory, leases: LeaseManager, widget: str) -> None:
    lease = lease_for(leases, widget)
    held = inventory.reserve(lease, widget, 3, key="r")
    inventory.confirm(lease, held.reservation_id or "", key="c")
    inventory.restock(lease, widget, 4, key="s")
    entries = inventory.history(widget)
    assert [(h.operation, h.on_hand_delta, h.reserved_delta) for h in entries] == [
        ("create", 10, 0),
        ("reserve", 0, 3),
        ("confirm", -3, -3),
        ("restock", 4, 0),
    ]
    assert sum(h.on_hand_delta for h in entries) == inventory.stock(widget).on_hand


async def test_async_inventory_runs_the_same_operations(inventory_url: str, leases: LeaseManager) -> None:
    async with AsyncInventory.from_url(inventory_url) as inventory:
        await inventory.add_sku("ASYNC-1", on_hand=5)
        old = lease_for(leases, "ASYNC-1", holder="A")
        held = await inventory.reserve(old, "ASYNC-1", 2, key="a1")
        assert (await inventory.reserve(old, "ASYNC-1", 2, key="a1")).replayed
        leases.break_lease(scope_of("ASYNC-1"), reason="A paused")
        new = lease_for(leases, "ASYNC-1", holder="B")
        await inventory.confirm(new, held.reservation_id or "", key="c1")
        with pytest.raises(StaleToken):
            await inventory.restock(old, "ASYNC-1", 1, key="late")
        level_now = await inventory.stock("ASYNC-1")
        assert (level_now.on_hand, level_now.reserved, level_now.available) == (3, 0, 3)
        assert await inventory.rejection_counts() == {"ASYNC-1": 1}
        assert await inventory.invariant_violations() == []


def test_timeline_tells_the_seed_story(inventory: Inventory, leases: LeaseManager, widget: str) -> None:
    from reservations.timeline import epochs

    a = lease_for(leases, widget, holder="A")
    leases.break_lease(scope_of(widget), reason="A paused")
    b = lease_for(leases, widget, holder="B")
    inventory.reserve(b, widget, 2, key="b-1")
    leases.release(b)
    with pytest.raises(StaleToken):
        inventory.reserve(a, widget, 5, key="a-1")
    timeline = inventory.timeline(widget, leases)
    assert [(e.kind, e.token) for e in timeline] == [
        ("write", 0),
        ("acquired", a.token),
        ("broken", a.token),
        ("acquired", b.token),
        ("write", b.token),
        ("released", b.token),
        ("rejected", a.token),
    ]
    by_token = {e.token: e for e in epochs(timeline)}
    assert (by_token[a.token].holder, by_token[a.token].ended) == ("A", "broken")
    assert [r.highest_token for r in by_token[a.token].rejections] == [b.token]
    assert [(w.operation, w.quantity) for w in by_token[b.token].writes] == [("reserve", 2)]
    assert by_token[b.token].ended == "released"


def test_expiry_and_a_concurrent_confirm_never_return_units_twice(
    inventory: Inventory, leases: LeaseManager, widget: str, inventory_url: str
) -> None:
    """The expiry sweep reads what is due, then changes stock: a confirm of one of those reservations
    committing in between must not be counted as well (it waits for the sweep, then finds it expired)."""
    import threading

    from fencing.plan import Atomic
    from fencing.sql import execute

    old = lease_for(leases, widget, holder="A")
    r1 = inventory.reserve(old, widget, 2, key="r1", hold_for=0.001)
    inventory.reserve(old, widget, 3, key="r2", hold_for=0.001)
    leases.break_lease(scope_of(widget), reason="A paused")
    new = lease_for(leases, widget, holder="B")
    deadline = time.monotonic() + 5
    while widget not in inventory.skus_with_due_holds():  # holds end by the database's clock
        assert time.monotonic() < deadline
    plan = expire_due(inventory, new, widget)
    step = next(plan)
    assert isinstance(step, Atomic)
    sweep = step.plan
    engine = make_engine(inventory_url)
    conn = engine.connect()
    conn.begin()
    statement = next(sweep)  # lock the stock row
    statement = sweep.send(execute(conn, statement))  # read the due reservations
    statement = sweep.send(execute(conn, statement))

    errors: list[BaseException] = []

    def confirm() -> None:
        try:
            inventory.confirm(old, r1.reservation_id or "", key="c1")
        except BaseException as exc:  # the confirm must fail: stale, or the reservation expired
            errors.append(exc)

    racer = threading.Thread(target=confirm)
    racer.start()
    racer.join(timeout=1.0)
    assert racer.is_alive(), "the confirm did not wait for the sweep holding the stock row"
    try:
        while True:
            statement = sweep.send(execute(conn, statement))
    except StopIteration:
        conn.commit()
    conn.close()
    racer.join(timeout=30)
    engine.dispose()
    assert errors and isinstance(errors[0], StaleToken | InvalidTransition)
    assert level(inventory, widget) == (10, 0, 10)
    assert inventory.invariant_violations() == []


def test_order_line_keys_never_collide_with_request_keys(
    inventory: Inventory, leases: LeaseManager, widget: str
) -> None:
    lease = lease_for(leases, widget)
    inventory.reserve_many({widget: lease}, [(widget, 1)], key="order-1")
    single = inventory.reserve(lease, widget, 1, key=f"order-1#{widget}")
    assert not single.replayed
    assert level(inventory, widget) == (10, 2, 8)


def test_a_request_closed_without_effect_can_never_apply_late(
    inventory: Inventory, leases: LeaseManager, widget: str, inventory_url: str
) -> None:
    """A dead-lettered request's key is closed: a copy still in flight replays that instead of reserving."""
    from reservations import RequestClosed

    closed = inventory.record_outcome("late-copy", "reserve", "dead_lettered", {"reason": "test"})
    assert closed.status == "dead_lettered"
    before = snapshot(inventory_url)
    with pytest.raises(RequestClosed) as late:
        inventory.reserve(lease_for(leases, widget), widget, 1, key="late-copy")
    assert late.value.status == "dead_lettered"
    assert snapshot(inventory_url) == before


def test_an_applied_request_cannot_be_recorded_as_dead_lettered(
    inventory: Inventory, leases: LeaseManager, widget: str
) -> None:
    from reservations.request_outcomes import AlreadyApplied

    inventory.reserve(lease_for(leases, widget), widget, 1, key="applied")
    with pytest.raises(AlreadyApplied):
        inventory.record_outcome("applied", "reserve", "dead_lettered", {"reason": "test"})
    assert inventory.request_outcome("applied") is None
    done = inventory.record_outcome("applied", "reserve", "reserved", {})
    assert done.status == "reserved"


def test_a_purged_key_reused_is_a_typed_conflict(
    inventory: Inventory, leases: LeaseManager, widget: str, inventory_url: str
) -> None:
    lease = lease_for(leases, widget)
    inventory.reserve(lease, widget, 1, key="old-key")
    engine = make_engine(inventory_url)
    with engine.begin() as conn:  # what purge_idempotency does once the record is old enough
        conn.execute(sa.text("DELETE FROM idempotency_keys WHERE key = 'old-key'"))
    engine.dispose()
    with pytest.raises(IdempotencyConflict):
        inventory.reserve(lease, widget, 1, key="old-key")
    assert level(inventory, widget) == (10, 1, 9)


def test_a_timeline_of_one_millisecond_still_runs_epoch_by_epoch() -> None:
    """Lease events and history rows of the same millisecond (a fast machine, two clocks of millisecond
    resolution): the seed story still reads acquired, writes, end, then the refusals it caused."""
    from fencing import LeaseEvent
    from reservations.timeline import merge
    from reservations.values import HistoryEntry

    at, a, b = 1_700_000_000.001, 7, 8

    def lease(event: str, token: int) -> LeaseEvent:
        return LeaseEvent("sku:S", event, token, "A" if token == a else "B", None, at)

    def row(kind: str, token: int, highest: int | None) -> HistoryEntry:
        return HistoryEntry(
            token, "S", at, kind, "reserve", token, None, None, 1, None, None, 0, 0, highest, None
        )

    # Handed over in the order least like the story: each source backwards.
    events = [lease("released", b), lease("acquired", b), lease("broken", a), lease("acquired", a)]
    rows = [row("rejected", a, b), row("write", b, b), row("write", 0, 0)]
    assert [(e.kind, e.token) for e in merge(events, rows)] == [
        ("write", 0), ("acquired", a), ("broken", a), ("acquired", b), ("write", b), ("released", b),
        ("rejected", a),
    ]  # fmt: skip
