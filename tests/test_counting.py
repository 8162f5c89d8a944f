"""Cycle counts and replenishment to par on SQLite and PostgreSQL: writes decided from a read under the
lease. Their effect, their replay by key, the refusal of a count below the held units, the stale epoch
refused and recorded, and the read that raises the fence so no older epoch writes between it and the
write decided from it; their messages and their commands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from fencing import LeaseManager, StaleToken
from fencing.engines import make_engine
from reservations import (
    AsyncInventory,
    IdempotencyConflict,
    InvalidRequest,
    Inventory,
    UnknownSku,
    schema,
    scope_of,
)
from reservations.counting import StockSeen
from reservations.errors import ConstraintRefused, CountBelowHeld, SeenInAnotherEpoch
from reservations.models import idempotency_keys, sku_history, stock
from reservations.validation import MAX_ON_HAND
from tasks.messages import InvalidMessage, parse, request_fingerprint
from testing.stock import TABLES, lease_for, level, table_rows
from testing.support import run


def snapshot(inventory_url: str) -> dict[str, Any]:
    """The stock rows, accepted writes and idempotency records: what a refused count must leave alone."""
    engine = make_engine(inventory_url)
    with engine.connect() as conn:
        state = {
            "stock": conn.execute(sa.select(stock).order_by(stock.c.sku)).all(),
            "writes": conn.execute(
                sa.select(sku_history).where(sku_history.c.kind == "write").order_by(sku_history.c.id)
            ).all(),
            "keys": conn.execute(sa.select(idempotency_keys).order_by(idempotency_keys.c.key)).all(),
        }
    engine.dispose()
    return state


def writes(inventory: Inventory, sku: str, operation: str) -> list[Any]:
    return [h for h in inventory.history(sku) if h.kind == "write" and h.operation == operation]


@pytest.fixture
def widget(inventory: Inventory) -> str:
    inventory.add_sku("WIDGET", on_hand=10)
    return "WIDGET"


# -- the read ------------------------------------------------------------------------------------------


def test_look_reads_the_stock_and_its_version(
    inventory: Inventory, leases: LeaseManager, widget: str
) -> None:
    lease = lease_for(leases, widget)
    first = inventory.look(lease, widget)
    assert (first.sku, first.on_hand, first.reserved, first.available) == (widget, 10, 0, 10)
    assert first.fence_token == lease.token  # the read raised the fence to its epoch
    (created,) = inventory.history(widget)
    assert first.version == created.id
    inventory.reserve(lease, widget, 3, key="r1")
    second = inventory.look(lease, widget)
    assert (second.on_hand, second.reserved, second.available) == (10, 3, 7)
    assert second.version == inventory.history(widget)[-1].id > first.version
    # A read writes nothing the history or the audit would see.
    assert [h.operation for h in inventory.history(widget)] == ["create", "reserve"]
    assert inventory.invariant_violations() == []
    with pytest.raises(UnknownSku):
        inventory.look(lease_for(leases, "NOPE"), "NOPE")


def test_a_read_under_a_newer_lease_fences_off_an_older_epochs_write(
    inventory: Inventory, leases: LeaseManager, widget: str, inventory_url: str
) -> None:
    """The older epoch has not been overtaken by any write, only by a read: its write is refused all the
    same, so nothing lands between the newer holder's read and the write it decides from it."""
    old = lease_for(leases, widget, holder="A")
    inventory.restock(old, widget, 1, key="a-first")
    leases.break_lease(scope_of(widget), reason="A paused past its lease")
    new = lease_for(leases, widget, holder="B")
    inventory.look(new, widget)
    before = snapshot(inventory_url)
    with pytest.raises(StaleToken) as stale:
        inventory.reserve(old, widget, 2, key="a-late")
    assert (stale.value.presented, stale.value.highest) == (old.token, new.token)
    assert snapshot(inventory_url) == before


def test_a_stale_read_is_refused_and_recorded(
    inventory: Inventory, leases: LeaseManager, widget: str
) -> None:
    old = lease_for(leases, widget, holder="A")
    leases.break_lease(scope_of(widget), reason="A paused past its lease")
    new = lease_for(leases, widget, holder="B")
    inventory.restock(new, widget, 1, key="b-writes")
    with pytest.raises(StaleToken):
        inventory.look(old, widget)
    rejected = [h for h in inventory.history(widget) if h.kind == "rejected"]
    assert [(h.operation, h.token, h.highest_token, h.holder) for h in rejected] == [
        ("look", old.token, new.token, "A")
    ]


# -- cycle count ---------------------------------------------------------------------------------------


def test_count_sets_on_hand_and_keeps_the_held_units(
    inventory: Inventory, leases: LeaseManager, widget: str
) -> None:
    lease = lease_for(leases, widget)
    inventory.reserve(lease, widget, 3, key="r1")
    seen = inventory.look(lease, widget)
    counted = inventory.count(lease, widget, 8, key="count-1", seen=seen)
    assert level(inventory, widget) == (8, 3, 5)
    assert (counted.operation, counted.quantity, counted.token) == ("count", -2, lease.token)
    assert (counted.stock[0].on_hand, counted.stock[0].available) == (8, 5)
    (row,) = writes(inventory, widget, "count")
    assert (row.quantity, row.on_hand_delta, row.reserved_delta, row.idempotency_key) == (
        -2,
        -2,
        0,
        "count-1",
    )
    assert json.loads(row.detail or "") == {"counted": 8, "seen": seen.version, "seen_on_hand": 10}
    # Up as well as down, to zero when nothing is held, and without a read when the figure is sent.
    inventory.release(lease, inventory.reservation("r1").id, key="rel-1")
    assert inventory.count(lease, widget, 12, key="count-2").quantity == 12 - 8
    assert inventory.count(lease, widget, 0, key="count-3").quantity == -12
    assert level(inventory, widget) == (0, 0, 0)
    assert json.loads(writes(inventory, widget, "count")[-1].detail or "") == {"counted": 0}
    assert inventory.invariant_violations() == []


def test_count_below_the_held_units_is_refused_and_writes_nothing(
    inventory: Inventory, leases: LeaseManager, widget: str, inventory_url: str
) -> None:
    lease = lease_for(leases, widget)
    inventory.reserve(lease, widget, 3, key="r1")
    inventory.add_sku("OTHER", on_hand=1)
    before = snapshot(inventory_url)
    with pytest.raises(CountBelowHeld) as refused:
        inventory.count(lease, widget, 2, key="count-short")
    assert (refused.value.sku, refused.value.counted, refused.value.held) == (widget, 2, 3)
    assert isinstance(refused.value, InvalidRequest)  # a request that cannot succeed as sent
    for counted in (-1, MAX_ON_HAND + 1, True, 2.0, "5", None):
        with pytest.raises(InvalidRequest):
            inventory.count(lease, widget, counted, key="count-bad")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):  # a figure decided from a read says which read
        inventory.count(lease, widget, 5, key="count-bad", shrinkage=1)
    with pytest.raises(InvalidRequest):  # ... of its own SKU
        inventory.count(lease, widget, 5, key="count-bad", seen=StockSeen("OTHER", 1, 0, 1, 0, 1))
    assert snapshot(inventory_url) == before
    # The same key is free for a count that can be written (a refusal is not its outcome).
    assert inventory.count(lease, widget, 3, key="count-short").quantity == -7
    assert level(inventory, widget) == (3, 3, 0)


def test_count_replays_by_key_and_a_figure_decided_from_a_read_replays_too(
    inventory: Inventory, leases: LeaseManager, widget: str
) -> None:
    lease = lease_for(leases, widget)
    first = inventory.count(lease, widget, 9, key="count-1")
    again = inventory.count(lease, widget, 9, key="count-1")
    assert again.replayed and (again.quantity, again.stock) == (first.quantity, first.stock)
    with pytest.raises(IdempotencyConflict):
        inventory.count(lease, widget, 7, key="count-1")
    # Shrinkage: the figure is decided from what was read. A redelivered request reads its own write and
    # decides another figure; the request, named by its shrinkage, replays the first count.
    seen = inventory.look(lease, widget)
    short = inventory.count(lease, widget, seen.on_hand - 2, key="count-2", seen=seen, shrinkage=2)
    reread = inventory.look(lease, widget)
    replay = inventory.count(lease, widget, reread.on_hand - 2, key="count-2", seen=reread, shrinkage=2)
    assert replay.replayed and replay.quantity == short.quantity == -2
    assert level(inventory, widget) == (7, 0, 7)
    assert [h.idempotency_key for h in writes(inventory, widget, "count")] == ["count-1", "count-2"]
    assert inventory.invariant_violations() == []


def test_a_stale_count_is_refused_recorded_and_changes_nothing(
    inventory: Inventory, leases: LeaseManager, widget: str, inventory_url: str
) -> None:
    old = lease_for(leases, widget, holder="A")
    seen = inventory.look(old, widget)
    leases.break_lease(scope_of(widget), reason="A paused past its lease")
    new = lease_for(leases, widget, holder="B")
    inventory.restock(new, widget, 5, key="b-restocks")
    before = snapshot(inventory_url)
    with pytest.raises(StaleToken) as stale:
        inventory.count(old, widget, seen.on_hand - 1, key="a-count", seen=seen, shrinkage=1)
    assert (stale.value.presented, stale.value.highest) == (old.token, new.token)
    assert snapshot(inventory_url) == before
    rejected = [h for h in inventory.history(widget) if h.kind == "rejected"]
    assert [(h.operation, h.idempotency_key, h.token, h.highest_token) for h in rejected] == [
        ("count", "a-count", old.token, new.token)
    ]
    assert level(inventory, widget) == (15, 0, 15)


def test_a_count_that_a_newer_epoch_followed_is_refused_at_the_stock_row(
    inventory_url: str, leases: LeaseManager
) -> None:
    """A decides its count from a read, pauses past its lease, and B ships units in a newer epoch. A's
    count would put the shipped units back on the shelf; the stock row refuses it. Without the fence
    the database's last guard (the trigger that never lowers a row's token) still refuses it, with a
    constraint error instead of lost ownership, so this test fails when the fence is off."""
    with Inventory.from_url(inventory_url) as inventory:
        inventory.add_sku("SHIP", on_hand=10)
        old = lease_for(leases, "SHIP", holder="A")
        seen = inventory.look(old, "SHIP")
        decided = seen.on_hand - 1  # one unit found missing
        leases.break_lease(scope_of("SHIP"), reason="A paused past its lease")
        new = lease_for(leases, "SHIP", holder="B")
        shipped = inventory.reserve(new, "SHIP", 4, key="order-1")
        inventory.confirm(new, shipped.reservation_id or "", key="ship-1")
        with pytest.raises(StaleToken):
            inventory.count(old, "SHIP", decided, key="a-count", seen=seen, shrinkage=1)
        assert level(inventory, "SHIP") == (6, 0, 6)
        assert writes(inventory, "SHIP", "count") == []


def test_without_the_fence_a_stale_count_overwrites_what_it_did_not_see(
    inventory_url: str, leases: LeaseManager
) -> None:
    """What the fence prevents, shown lease-only: with the fence off and the database's trigger out of the
    way, A's stale count lands and the four shipped units are back on hand; the history shows the count
    was decided from a version older than the writes before it."""
    engine = make_engine(inventory_url)
    with engine.begin() as conn:
        on = "ON stock" if engine.dialect.name == "postgresql" else ""
        conn.execute(sa.text(f"DROP TRIGGER stock_fence_never_lowers {on}".strip()))
    engine.dispose()
    with Inventory.from_url(inventory_url, enforce_fence=False) as inventory:
        inventory.add_sku("SHIP", on_hand=10)
        old = lease_for(leases, "SHIP", holder="A")
        seen = inventory.look(old, "SHIP")
        leases.break_lease(scope_of("SHIP"), reason="A paused past its lease")
        new = lease_for(leases, "SHIP", holder="B")
        shipped = inventory.reserve(new, "SHIP", 4, key="order-1")
        inventory.confirm(new, shipped.reservation_id or "", key="ship-1")
        inventory.count(old, "SHIP", seen.on_hand - 1, key="a-count", seen=seen, shrinkage=1)
        assert level(inventory, "SHIP") == (9, 0, 9)  # 4 units shipped, 1 missing: 5 are on the shelf
        (count,) = writes(inventory, "SHIP", "count")
        missed = [h for h in inventory.history("SHIP") if seen.version < h.id < count.id and h.on_hand_delta]
        assert [h.operation for h in missed] == ["confirm"]
        assert inventory.invariant_violations() != []  # written behind a newer token


def test_the_fence_trigger_refuses_a_stale_count_when_the_guard_is_off(
    inventory_url: str, leases: LeaseManager
) -> None:
    with Inventory.from_url(inventory_url, enforce_fence=False) as inventory:
        inventory.add_sku("SHIP", on_hand=10)
        old = lease_for(leases, "SHIP", holder="A")
        seen = inventory.look(old, "SHIP")
        leases.break_lease(scope_of("SHIP"), reason="A paused past its lease")
        inventory.restock(lease_for(leases, "SHIP", holder="B"), "SHIP", 2, key="b")
        with pytest.raises(ConstraintRefused):
            inventory.count(old, "SHIP", 9, key="a-count", seen=seen)
        assert level(inventory, "SHIP") == (12, 0, 12)


# -- replenishment to par ------------------------------------------------------------------------------


def test_replenish_books_par_less_what_was_seen(
    inventory: Inventory, leases: LeaseManager, widget: str
) -> None:
    lease = lease_for(leases, widget)
    inventory.reserve(lease, widget, 4, key="r1")
    seen = inventory.look(lease, widget)
    booked = inventory.replenish(lease, widget, 25, key="rep-1", seen=seen)
    assert (booked.operation, booked.quantity) == ("replenish", 15)
    assert level(inventory, widget) == (25, 4, 21)
    (row,) = writes(inventory, widget, "replenish")
    assert (row.quantity, row.on_hand_delta, row.idempotency_key) == (15, 15, "rep-1")
    assert json.loads(row.detail or "") == {"par": 25, "seen": seen.version, "seen_on_hand": 10}
    # Replayed by key: a redelivery that reads the level its first run left books nothing more.
    again = inventory.replenish(lease, widget, 25, key="rep-1", seen=inventory.look(lease, widget))
    assert again.replayed and again.quantity == 15
    with pytest.raises(IdempotencyConflict):
        inventory.replenish(lease, widget, 30, key="rep-1", seen=seen)
    # At or above par nothing is ordered; the decision is still written, with what it saw.
    at_par = inventory.replenish(lease, widget, 20, key="rep-2", seen=inventory.look(lease, widget))
    assert at_par.quantity == 0 and level(inventory, widget) == (25, 4, 21)
    assert [h.on_hand_delta for h in writes(inventory, widget, "replenish")] == [15, 0]
    assert inventory.invariant_violations() == []


def test_replenish_input_is_checked_and_a_stale_one_refused(
    inventory: Inventory, leases: LeaseManager, widget: str, inventory_url: str
) -> None:
    old = lease_for(leases, widget, holder="A")
    seen = inventory.look(old, widget)
    for par in (0, -1, MAX_ON_HAND + 1, 1.5, "20"):
        with pytest.raises(InvalidRequest):
            inventory.replenish(old, widget, par, key="rep-bad", seen=seen)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        inventory.replenish(old, widget, 20, key="rep-bad", seen=None)  # type: ignore[arg-type]
    leases.break_lease(scope_of(widget), reason="A paused past its lease")
    new = lease_for(leases, widget, holder="B")
    inventory.replenish(new, widget, 20, key="rep-b", seen=inventory.look(new, widget))
    before = snapshot(inventory_url)
    with pytest.raises(StaleToken):  # A would order 10 more on top of B's 10: 30 on hand, par 20
        inventory.replenish(old, widget, 20, key="rep-a", seen=seen)
    assert snapshot(inventory_url) == before
    assert level(inventory, widget) == (20, 0, 20)


def test_a_read_under_another_token_is_refused_and_writes_nothing(
    inventory: Inventory, leases: LeaseManager, widget: str, inventory_url: str
) -> None:
    """Read under A's token, 50 units delivered under B's: B's replenishment to par 20 decided from A's
    read of 10 would order 10 on top of 60, and the fence accepts B's token. Refused before any statement,
    as is a count from that read, and a newer read presented with the older lease."""
    old = lease_for(leases, widget, holder="A")
    seen = inventory.look(old, widget)
    leases.break_lease(scope_of(widget), reason="A paused past its lease")
    new = lease_for(leases, widget, holder="B")
    inventory.restock(new, widget, 50, key="delivery")
    newer = inventory.look(new, widget)
    before = table_rows(inventory_url, TABLES)
    with pytest.raises(SeenInAnotherEpoch) as refused:
        inventory.replenish(new, widget, 20, key="par", seen=seen)
    error = refused.value
    assert (error.sku, error.seen_token, error.token) == (widget, old.token, new.token)
    assert isinstance(error, InvalidRequest)  # a request that cannot succeed as sent: ends invalid
    with pytest.raises(SeenInAnotherEpoch):
        inventory.count(new, widget, seen.on_hand - 1, key="count", seen=seen, shrinkage=1)
    with pytest.raises(SeenInAnotherEpoch):
        inventory.count(new, widget, 9, key="count", seen=seen)
    with pytest.raises(SeenInAnotherEpoch):  # not even a rejection row: it never reached the fence
        inventory.replenish(old, widget, 20, key="par", seen=newer)
    assert table_rows(inventory_url, TABLES) == before
    # The keys are free for the same requests decided from a read under the lease that writes.
    assert inventory.replenish(new, widget, 20, key="par", seen=newer).quantity == 0
    assert level(inventory, widget) == (60, 0, 60)
    assert inventory.invariant_violations() == []


# -- the async shell and the messages ------------------------------------------------------------------


async def test_async_inventory_counts_and_replenishes(inventory_url: str, leases: LeaseManager) -> None:
    async with AsyncInventory.from_url(inventory_url) as inventory:
        await inventory.add_sku("ASYNC-C", on_hand=5)
        lease = lease_for(leases, "ASYNC-C")
        seen = await inventory.look(lease, "ASYNC-C")
        assert (await inventory.count(lease, "ASYNC-C", 4, key="c", seen=seen)).quantity == -1
        booked = await inventory.replenish(
            lease, "ASYNC-C", 9, key="p", seen=await inventory.look(lease, "ASYNC-C")
        )
        assert booked.quantity == 5
        level_now = await inventory.stock("ASYNC-C")
        assert (level_now.on_hand, level_now.available) == (9, 9)
        assert await inventory.invariant_violations() == []
        leases.break_lease(scope_of("ASYNC-C"), reason="the holder paused past its lease")
        with pytest.raises(SeenInAnotherEpoch):  # a read of the lease before
            await inventory.replenish(lease_for(leases, "ASYNC-C"), "ASYNC-C", 20, key="p2", seen=seen)
        assert (await inventory.stock("ASYNC-C")).on_hand == 9


def test_count_and_replenish_messages_are_checked_and_named_by_what_was_sent() -> None:
    by_figure = parse("count", [], {"sku": "W", "counted": 0, "idempotency_key": "k"})
    assert by_figure.args == {"sku": "W", "counted": 0, "shrinkage": None}
    by_shrinkage = parse("count", [], {"sku": "W", "shrinkage": 2, "idempotency_key": "k"})
    assert by_shrinkage.args == {"sku": "W", "counted": None, "shrinkage": 2}
    assert by_figure.fingerprint != by_shrinkage.fingerprint
    assert by_shrinkage.fingerprint == request_fingerprint("count", {"sku": "W", "shrinkage": 2})
    for wrong in ({}, {"counted": 1, "shrinkage": 1}, {"counted": -1}, {"shrinkage": -1}, {"counted": "1"}):
        with pytest.raises(InvalidMessage):
            parse("count", [], {"sku": "W", "idempotency_key": "k", **wrong})
    replenish = parse("replenish", ["W", 40, "k"], {})
    assert (replenish.operation, replenish.args) == ("replenish", {"sku": "W", "par": 40})
    for wrong in ({}, {"par": 0}, {"par": True}):
        with pytest.raises(InvalidMessage):
            parse("replenish", [], {"sku": "W", "idempotency_key": "k", **wrong})


# -- the command line ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "code", "said"),
    [
        (("count", "WIDGET", "3.0", "--key", "k"), 2, "counted '3.0'"),
        (("count", "WIDGET", str(MAX_ON_HAND + 1), "--key", "k"), 2, "counted must be between 0 and"),
        (("replenish", "WIDGET", "--par", "0", "--key", "k"), 2, "par must be between 1 and"),
        (("replenish", "WIDGET", "--key", "k"), 2, "--par"),
        # Past its checks, the request goes to the broker: unreachable here.
        (("count", "WIDGET", "0", "--key", "k"), 4, "broker unreachable"),
        (("replenish", "WIDGET", "--par", "40", "--key", "k"), 4, "broker unreachable"),
    ],
)
def test_the_count_and_replenish_commands_check_their_input_and_go_through_the_workers(
    tmp_path: Path, args: tuple[str, ...], code: int, said: str
) -> None:
    env = {
        "RESERVATIONS_DATABASE_URL": f"sqlite:///{tmp_path / 'inventory.sqlite3'}",
        "RESERVATIONS_BROKER_URL": "redis://127.0.0.1:1/0",
    }
    schema.upgrade(env["RESERVATIONS_DATABASE_URL"])  # a request is recorded before it is published
    done = run(*args, env=env, columns=200)
    assert done.returncode == code, done.stdout + done.stderr
    assert said in done.stderr
    for command in ("count", "replenish"):
        assert "WRITES (through the workers)" in run(command, "--help", env=env, columns=200).stdout
