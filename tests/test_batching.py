"""Hot-SKU batching on SQLite and PostgreSQL: requests handed to the lease holder get exactly one final
outcome each, a key is applied at most once, stock runs out in arrival order, and a stale holder's batch
is refused whole (and would not be without the fence).
"""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from fencing import LeaseLost, LeaseManager, StaleToken
from fencing.engines import make_engine
from reservations import AsyncInventory, InvalidRequest, Inventory, pending, scope_of
from reservations.audit import Rule
from reservations.models import pending_reservations, reservations
from testing.stock import lease_for, level, snapshot, statuses


@pytest.fixture
def hot(inventory: Inventory) -> str:
    inventory.add_sku("HOT", on_hand=10)
    return "HOT"


def test_holder_serves_queued_requests_in_one_batch(
    inventory: Inventory, leases: LeaseManager, hot: str
) -> None:
    keys = [f"flash-{i}" for i in range(5)]
    for i, key in enumerate(keys):
        queued = inventory.hand_off(hot, 1 + i % 2, key=key, task_id=f"task-{i}")
        assert queued == pending.Queued(first=i == 0)
    assert inventory.pending_count(hot) == 5
    assert statuses(inventory, keys) == dict.fromkeys(keys)

    lease = lease_for(leases, hot)
    served = inventory.serve_pending(lease, hot, limit=100, task_id="holder-task", worker="w1")

    assert sorted(r.key for r in served) == keys
    assert {r.status for r in served} == {"reserved"}
    assert inventory.pending_count(hot) == 0
    assert level(inventory, hot) == (10, 7, 3)
    held = inventory.reservations(hot)
    assert sorted(r.idempotency_key for r in held) == keys
    assert {r.token for r in held} == {lease.token}
    for i, key in enumerate(keys):
        outcome = inventory.request_outcome(key)
        assert outcome is not None
        assert outcome.task_id == f"task-{i}"  # the caller's own task, served by another
        assert outcome.detail["served_by"] == "holder-task"
        assert outcome.detail["token"] == lease.token
        assert [a.result for a in inventory.attempts(key)] == ["applied"]
    writes = [h for h in inventory.history(hot) if h.kind == "write" and h.operation == "reserve"]
    assert len(writes) == 5
    assert inventory.invariant_violations() == []
    assert inventory.serve_pending(lease, hot, limit=100) == []  # nothing left to serve


def test_batches_take_the_oldest_first_and_respect_the_limit(
    inventory: Inventory, leases: LeaseManager, hot: str
) -> None:
    keys = [f"q-{i}" for i in range(7)]
    for key in keys:
        inventory.hand_off(hot, 1, key=key)
    lease = lease_for(leases, hot)
    first = inventory.serve_pending(lease, hot, limit=3)
    assert [r.key for r in sorted(first, key=lambda r: r.key)] == keys[:3]
    assert inventory.pending_count(hot) == 4
    rest = inventory.serve_pending(lease, hot, limit=100)
    assert sorted(r.key for r in rest) == keys[3:]


def test_stock_runs_out_in_arrival_order_and_the_refusal_is_final(
    inventory: Inventory, leases: LeaseManager, hot: str
) -> None:
    keys = [f"sale-{i}" for i in range(6)]
    for key in keys:
        inventory.hand_off(hot, 3, key=key)  # 10 units: the first three get 3 each
    lease = lease_for(leases, hot)
    inventory.serve_pending(lease, hot, limit=100)

    assert statuses(inventory, keys) == {
        **dict.fromkeys(keys[:3], "reserved"),
        **dict.fromkeys(keys[3:], "insufficient_stock"),
    }
    refused = inventory.request_outcome(keys[3])
    assert refused is not None and refused.detail["available"] == 1
    assert level(inventory, hot) == (10, 9, 1)
    # A late copy of a refused request replays the refusal even though stock came back meanwhile.
    inventory.restock(lease, hot, 10, key="restock")
    from reservations import InsufficientStock

    with pytest.raises(InsufficientStock):
        inventory.reserve(lease, hot, 3, key=keys[3])
    assert level(inventory, hot) == (20, 9, 11)


def test_a_key_applied_directly_is_replayed_not_applied_again(
    inventory: Inventory, leases: LeaseManager, hot: str
) -> None:
    lease = lease_for(leases, hot)
    direct = inventory.reserve(lease, hot, 2, key="twice")
    inventory.hand_off(hot, 2, key="twice")  # a redelivered copy that found the lease busy
    (served,) = inventory.serve_pending(lease, hot, limit=10)
    assert served.status == "reserved"
    assert served.detail["reservation_ids"] == [direct.reservation_id]
    assert [a.result for a in inventory.attempts("twice")] == ["replayed"]
    assert level(inventory, hot) == (10, 2, 8)


def test_handing_off_twice_queues_once_and_an_ended_request_not_at_all(
    inventory: Inventory, leases: LeaseManager, hot: str
) -> None:
    assert inventory.hand_off(hot, 1, key="dup") == pending.Queued(first=True)
    assert inventory.hand_off(hot, 1, key="dup") == pending.Queued(first=False)
    assert inventory.pending_count(hot) == 1
    inventory.serve_pending(lease_for(leases, hot), hot, limit=10)
    again = inventory.hand_off(hot, 1, key="dup")
    assert isinstance(again, pending.Ended) and again.result.status == "reserved"
    assert inventory.pending_count() == 0
    assert level(inventory, hot) == (10, 1, 9)


def test_a_request_that_ended_while_queued_is_only_removed(
    inventory: Inventory, leases: LeaseManager, hot: str
) -> None:
    inventory.hand_off(hot, 1, key="gave-up")
    inventory.hand_off(hot, 1, key="served")
    inventory.record_outcome("gave-up", "reserve", "dead_lettered", {"reason": "test"})
    served = inventory.serve_pending(lease_for(leases, hot), hot, limit=10)
    assert [r.key for r in served] == ["served"]
    assert inventory.pending_count() == 0
    gave_up = inventory.request_outcome("gave-up")
    assert gave_up is not None and gave_up.status == "dead_lettered"
    assert level(inventory, hot) == (10, 1, 9)


def test_a_batch_of_requests_that_all_ended_elsewhere_does_not_hide_the_rest(
    inventory: Inventory, leases: LeaseManager, hot: str
) -> None:
    """An empty answer means an empty queue (a server stops on one), even when the oldest full batch
    had all ended elsewhere."""
    for key in ("ended-1", "ended-2", "live"):
        inventory.hand_off(hot, 1, key=key)
    for key in ("ended-1", "ended-2"):
        inventory.record_outcome(key, "reserve", "dead_lettered", {"reason": "test"})
    served = inventory.serve_pending(lease_for(leases, hot), hot, limit=2)
    assert [r.key for r in served] == ["live"]
    assert inventory.pending_count() == 0


def test_conflicting_and_closed_keys_end_invalid_without_effect(
    inventory: Inventory, leases: LeaseManager, hot: str
) -> None:
    lease = lease_for(leases, hot)
    inventory.restock(lease, hot, 1, key="used-for-restock")
    inventory.hand_off(hot, 1, key="used-for-restock")
    served = {r.key: r for r in inventory.serve_pending(lease, hot, limit=10)}
    assert served["used-for-restock"].status == "invalid"
    assert served["used-for-restock"].detail["error"] == "IdempotencyConflict"
    assert level(inventory, hot) == (11, 0, 11)


def test_unknown_sku_ends_invalid_and_closes_the_key(
    inventory: Inventory, leases: LeaseManager, inventory_url: str
) -> None:
    inventory.hand_off("GHOST", 1, key="ghost-1")
    lease = lease_for(leases, "GHOST")
    (served,) = inventory.serve_pending(lease, "GHOST", limit=10)
    assert served.status == "invalid" and served.detail["error"] == "UnknownSku"
    inventory.add_sku("GHOST", on_hand=5)
    from reservations import RequestClosed

    with pytest.raises(RequestClosed):  # the key ended; a late copy cannot reserve now
        inventory.reserve(lease, "GHOST", 1, key="ghost-1")
    assert level(inventory, "GHOST") == (5, 0, 5)


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "lease-only"])
def test_a_stale_holders_batch_is_refused_whole_and_stays_queued(
    inventory_url: str, inventory: Inventory, leases: LeaseManager, hot: str, fenced: bool
) -> None:
    """Holder A pauses past its lease; B takes over and writes. A's batch must change nothing.

    The lease-only variant (no token condition, no never-lowers trigger) shows the fence is what stops
    it: there A's late batch is accepted after B's newer write.
    """
    old = lease_for(leases, hot, holder="A")
    for i in range(3):
        inventory.hand_off(hot, 1, key=f"late-{i}")
    leases.break_lease(scope_of(hot), reason="A paused past its lease")
    new = lease_for(leases, hot, holder="B")
    inventory.restock(new, hot, 1, key="b-writes")
    if not fenced:
        engine = make_engine(inventory_url)
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "DROP TRIGGER stock_fence_never_lowers"
                    + ("" if "sqlite" in inventory_url else " ON stock")
                )
            )
        engine.dispose()
    before = snapshot(inventory_url)

    with Inventory.from_url(inventory_url, enforce_fence=fenced) as stale_holder:
        if not fenced:
            stale_holder.serve_pending(old, hot, limit=10)
            assert level(inventory, hot) == (11, 3, 8)
            assert any(v.rule is Rule.TOKEN_ORDER for v in inventory.invariant_violations())
            return
        with pytest.raises(StaleToken) as stale:
            stale_holder.serve_pending(old, hot, limit=10)
        assert (stale.value.presented, stale.value.highest) == (old.token, new.token)
        with pytest.raises(LeaseLost):  # lost ownership is terminal: no second batch under that lease
            stale_holder.serve_pending(old, hot, limit=10)

    assert snapshot(inventory_url) == before
    assert inventory.pending_count(hot) == 3
    assert statuses(inventory, [f"late-{i}" for i in range(3)]) == dict.fromkeys(
        [f"late-{i}" for i in range(3)]
    )
    rejected = [h for h in inventory.history(hot) if h.kind == "rejected"]
    assert [(h.token, h.highest_token, h.holder) for h in rejected] == [(old.token, new.token, "A")]
    # The new holder serves what the stale one could not.
    served = inventory.serve_pending(new, hot, limit=10)
    assert {r.status for r in served} == {"reserved"} and len(served) == 3
    assert level(inventory, hot) == (11, 3, 8)
    assert inventory.invariant_violations() == []


def test_a_stale_holder_serves_nothing_even_when_nothing_would_be_written(
    inventory_url: str, inventory: Inventory, leases: LeaseManager, hot: str
) -> None:
    """Every queued request asks for more than there is: the batch would change no stock, only end the
    requests. A stale holder must not end them either; the fence refuses it before any decision."""
    old = lease_for(leases, hot, holder="A")
    keys = [f"big-{i}" for i in range(3)]
    for key in keys:
        inventory.hand_off(hot, 50, key=key)
    leases.break_lease(scope_of(hot), reason="A paused past its lease")
    new = lease_for(leases, hot, holder="B")
    inventory.restock(new, hot, 1, key="b-writes")
    before = snapshot(inventory_url)

    with pytest.raises(StaleToken):
        inventory.serve_pending(old, hot, limit=10)
    assert snapshot(inventory_url) == before
    assert inventory.pending_count(hot) == 3
    assert statuses(inventory, keys) == dict.fromkeys(keys)
    served = inventory.serve_pending(new, hot, limit=10)
    assert {r.status for r in served} == {"insufficient_stock"}


def test_a_batch_holds_each_request_against_what_the_ones_before_it_left(
    inventory: Inventory, leases: LeaseManager, hot: str
) -> None:
    lease = lease_for(leases, hot)
    asked = {"a": 4, "b": 5, "c": 3, "d": 1}
    for key, quantity in asked.items():
        inventory.hand_off(hot, quantity, key=key)
    served = {r.key: r for r in inventory.serve_pending(lease, hot, limit=10)}
    assert {k: r.status for k, r in served.items()} == {
        "a": "reserved",
        "b": "reserved",
        "c": "insufficient_stock",
        "d": "reserved",
    }
    # Each outcome reports the level right after its own request, as one write each would have.
    assert [served[k].detail["stock"][0]["available"] for k in ("a", "b", "d")] == [6, 1, 0]
    assert served["c"].detail["available"] == 1
    assert level(inventory, hot) == (10, 10, 0)
    assert sorted(r.quantity for r in inventory.reservations(hot)) == [1, 4, 5]
    assert inventory.invariant_violations() == []


def test_the_database_refuses_reserved_units_that_differ_from_held_reservations(
    inventory_url: str, inventory: Inventory, leases: LeaseManager, hot: str
) -> None:
    """The backstop under every path: a reservation row without the matching stock change is refused,
    whether it comes alone or with others in one statement."""
    inventory.reserve(lease_for(leases, hot), hot, 2, key="real")
    before = snapshot(inventory_url)
    engine = make_engine(inventory_url)
    row = {"sku": hot, "quantity": 1, "status": "held", "token": 1, "created_ms": 0}
    try:
        for rows in ([{**row, "id": "r_forged"}], [{**row, "id": f"r_forged_{i}"} for i in range(3)]):
            with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
                conn.execute(sa.insert(reservations).values(rows))
    finally:
        engine.dispose()
    assert snapshot(inventory_url) == before


def test_bad_batch_requests_are_refused_and_nothing_written(
    inventory: Inventory, leases: LeaseManager, hot: str, inventory_url: str
) -> None:
    inventory.hand_off(hot, 1, key="queued")
    inventory.add_sku("OTHER", on_hand=1)
    before = snapshot(inventory_url)
    with pytest.raises(InvalidRequest):
        inventory.hand_off(hot, 0, key="zero")
    with pytest.raises(InvalidRequest):
        inventory.hand_off(hot, 10**9, key="absurd")
    with pytest.raises(InvalidRequest):
        inventory.hand_off("bad sku!", 1, key="odd")
    with pytest.raises(InvalidRequest):
        inventory.hand_off(hot, 1, key="x" * 500)
    with pytest.raises(InvalidRequest):
        inventory.hand_off(hot, 1, key="hold", hold_for=-1)
    lease = lease_for(leases, hot)
    for limit in (0, -1, 10**6, True):
        with pytest.raises(InvalidRequest):
            inventory.serve_pending(lease, hot, limit=limit)
    with pytest.raises(InvalidRequest):  # a lease of another SKU cannot serve this one
        inventory.serve_pending(lease_for(leases, "OTHER"), hot, limit=10)
    assert snapshot(inventory_url) == before
    assert inventory.pending_count() == 1


def test_pending_rows_carry_what_the_request_asked(
    inventory: Inventory, leases: LeaseManager, hot: str, inventory_url: str
) -> None:
    inventory.hand_off(hot, 2, key="with-hold", hold_for=60, task_id="t-1", epochs=1)
    engine = make_engine(inventory_url)
    with engine.connect() as conn:
        row = conn.execute(sa.select(pending_reservations)).one()
    engine.dispose()
    assert (row.sku, row.quantity, row.hold_ms, row.task_id, row.epochs) == (hot, 2, 60_000, "t-1", 1)
    (served,) = inventory.serve_pending(lease_for(leases, hot), hot, limit=10)
    assert served.epochs == 1
    (held,) = inventory.reservations(hot)
    assert held.hold_expires_at is not None and held.hold_expires_at - held.created_at == pytest.approx(60)
    assert json.loads(json.dumps(served.detail))["quantity"] == 2


async def test_async_inventory_hands_off_and_serves(inventory_url: str, leases: LeaseManager) -> None:
    async with AsyncInventory.from_url(inventory_url) as inventory:
        await inventory.add_sku("ASYNC", on_hand=3)
        assert await inventory.hand_off("ASYNC", 2, key="a-1") == pending.Queued(first=True)
        assert await inventory.pending_count("ASYNC") == 1
        served = await inventory.serve_pending(lease_for(leases, "ASYNC"), "ASYNC", limit=10)
        assert [r.status for r in served] == ["reserved"]
        assert (await inventory.stock("ASYNC")).available == 1


def test_waiting_counts_and_the_purge_of_ended_waits(
    inventory: Inventory, leases: LeaseManager, hot: str
) -> None:
    inventory.add_sku("COLD", on_hand=1)
    for i in range(3):
        inventory.hand_off(hot, 1, key=f"w-{i}")
    inventory.hand_off("COLD", 1, key="cold-0")
    assert inventory.waiting_by_sku() == {"COLD": 1, hot: 3}
    # A waiting request that ended on its own (dead-lettered by its check) is dropped by the purge;
    # the others keep waiting.
    inventory.record_outcome("cold-0", "reserve", "dead_lettered", {"reason": "test"})
    assert inventory.purge_ended_waits() == 1
    assert inventory.waiting_by_sku() == {hot: 3}
    assert inventory.purge_ended_waits() == 0
    inventory.serve_pending(lease_for(leases, hot), hot, limit=10)
    assert inventory.waiting_by_sku() == {}


def test_skus_waiting_lists_only_requests_older_than_asked(
    inventory: Inventory, leases: LeaseManager, hot: str
) -> None:
    inventory.hand_off(hot, 1, key="old-enough")
    assert inventory.skus_waiting(older_than=0) == [hot]
    assert inventory.skus_waiting(older_than=3600) == []
    with pytest.raises(InvalidRequest):
        inventory.skus_waiting(older_than=-1)
    inventory.serve_pending(lease_for(leases, hot), hot, limit=10)
    assert inventory.skus_waiting(older_than=0) == []


def test_a_purged_key_whose_reservation_lives_on_does_not_block_the_queue(
    inventory: Inventory, leases: LeaseManager, hot: str, inventory_url: str
) -> None:
    lease = lease_for(leases, hot)
    inventory.reserve(lease, hot, 1, key="old-key")
    engine = make_engine(inventory_url)
    with engine.begin() as conn:  # what the retention purge does once the record is old enough
        conn.execute(sa.text("DELETE FROM idempotency_keys WHERE key = 'old-key'"))
    engine.dispose()
    for key in ("old-key", "new-1", "new-2"):
        inventory.hand_off(hot, 1, key=key)
    served = {r.key: r for r in inventory.serve_pending(lease, hot, limit=10)}
    assert served["old-key"].status == "invalid"
    assert served["old-key"].detail["error"] == "IdempotencyConflict"
    assert (served["new-1"].status, served["new-2"].status) == ("reserved", "reserved")
    assert inventory.pending_count(hot) == 0
    assert level(inventory, hot) == (10, 3, 7)
