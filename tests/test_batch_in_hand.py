"""A hot SKU's batch with requests in hand (reservations.batching.serve_pending(in_hand=...)) on SQLite and
PostgreSQL: the listed requests are served oldest first, then those in hand in the order handed, in one
fenced transaction; a key read twice is served once, where it came first; a request in hand whose key
already ended gets no outcome; stock runs out in arrival order; bad input and a stale lease write nothing.
"""

from __future__ import annotations

import pytest

from fencing import LeaseLost, LeaseManager, StaleToken
from reservations import InvalidRequest, Inventory, scope_of
from reservations.batch_statement import InHand
from reservations.request_outcomes import RequestResult
from testing.stock import lease_for, level, snapshot, statuses

SKU = "HOT"


def in_hand(key: str, quantity: int = 1, sku: str = SKU, hold_ms: int | None = None) -> InHand:
    return InHand(key=key, sku=sku, quantity=quantity, hold_ms=hold_ms, task_id=f"task-{key}", epochs=0)


def by_key(served: list[RequestResult]) -> dict[str, RequestResult]:
    keyed = {r.key: r for r in served}
    assert len(keyed) == len(served), f"a key got more than one outcome: {[r.key for r in served]}"
    return keyed


def available_after(result: RequestResult) -> int:
    """The SKU's available units right after this request was held (its outcome's level)."""
    (after,) = result.detail["stock"]
    available: int = after["available"]
    return available


def test_listed_then_in_hand_are_all_served_in_one_batch_in_arrival_order(
    inventory: Inventory, leases: LeaseManager
) -> None:
    inventory.add_sku(SKU, on_hand=20)
    inventory.hand_off(SKU, 1, key="listed-1", task_id="task-listed-1")
    inventory.hand_off(SKU, 2, key="listed-2", task_id="task-listed-2")
    # Handed in an order that is not the keys' order: the batch keeps the order handed.
    hand = [in_hand("hand-z", 3), in_hand("hand-a", 4)]
    lease = lease_for(leases, SKU)

    served = by_key(
        inventory.serve_pending(lease, SKU, limit=100, task_id="holder", worker="w1", in_hand=hand)
    )

    keys = ["listed-1", "listed-2", "hand-z", "hand-a"]
    assert sorted(served) == sorted(keys)
    assert {r.status for r in served.values()} == {"reserved"}
    # Each outcome reports the level right after its own request: listed first, then the hand's in order.
    assert [available_after(served[k]) for k in keys] == [19, 17, 14, 10]
    assert level(inventory, SKU) == (20, 10, 10)
    assert inventory.pending_count(SKU) == 0

    held = {r.idempotency_key: r for r in inventory.reservations(SKU)}
    assert sorted(held) == sorted(keys)
    for key, quantity in zip(keys, (1, 2, 3, 4), strict=True):
        stored = inventory.request_outcome(key)
        assert stored is not None and stored.status == "reserved"
        assert stored.task_id == f"task-{key}"  # the sender's own task, served by the holder's
        assert stored.worker == "w1"
        assert stored.detail["served_by"] == "holder"
        assert stored.detail["reservation_ids"] == [held[key].id]
        assert held[key].quantity == quantity and held[key].token == lease.token
        assert [a.result for a in inventory.attempts(key)] == ["applied"]
    assert inventory.invariant_violations() == []
    assert inventory.serve_pending(lease, SKU, limit=100) == []  # nothing left


def test_requests_in_hand_alone_are_served_in_the_order_handed(
    inventory: Inventory, leases: LeaseManager
) -> None:
    inventory.add_sku(SKU, on_hand=10)
    hand = [in_hand(f"h-{i}", 1 + i % 3) for i in (3, 1, 4, 0, 2)]
    served = by_key(inventory.serve_pending(lease_for(leases, SKU), SKU, limit=100, in_hand=hand))

    assert [served[h.key].status for h in hand] == ["reserved"] * 5
    assert [available_after(served[h.key]) for h in hand] == [9, 7, 5, 4, 1]
    assert level(inventory, SKU) == (10, 9, 1)
    assert inventory.invariant_violations() == []


def test_a_key_both_listed_and_in_hand_is_served_once_where_it_came_first(
    inventory: Inventory, leases: LeaseManager
) -> None:
    inventory.add_sku(SKU, on_hand=10)
    inventory.hand_off(SKU, 2, key="both")
    inventory.hand_off(SKU, 1, key="listed")
    hand = [in_hand("both", 2), in_hand("solo", 1)]

    served = by_key(inventory.serve_pending(lease_for(leases, SKU), SKU, limit=100, in_hand=hand))

    assert sorted(served) == ["both", "listed", "solo"]
    assert {r.status for r in served.values()} == {"reserved"}
    # Served at its listed place (before "listed"), not at its place in hand (after it).
    assert [available_after(served[k]) for k in ("both", "listed", "solo")] == [8, 7, 6]
    assert [r.idempotency_key for r in inventory.reservations(SKU)].count("both") == 1
    assert [a.result for a in inventory.attempts("both")] == ["applied"]
    assert level(inventory, SKU) == (10, 4, 6)
    assert inventory.pending_count(SKU) == 0
    assert inventory.invariant_violations() == []


def test_a_key_handed_twice_is_served_once(inventory: Inventory, leases: LeaseManager) -> None:
    inventory.add_sku(SKU, on_hand=10)
    hand = [in_hand("twice", 3), in_hand("twice", 3)]
    (served,) = inventory.serve_pending(lease_for(leases, SKU), SKU, limit=100, in_hand=hand)
    assert (served.key, served.status) == ("twice", "reserved")
    assert len(inventory.reservations(SKU)) == 1
    assert level(inventory, SKU) == (10, 3, 7)


def test_a_request_in_hand_whose_key_was_dead_lettered_gets_no_outcome(
    inventory_url: str, inventory: Inventory, leases: LeaseManager
) -> None:
    inventory.add_sku(SKU, on_hand=10)
    ended = inventory.record_outcome("gone", "reserve", "dead_lettered", {"reason": "test"})
    before = snapshot(inventory_url)
    lease = lease_for(leases, SKU)

    assert inventory.serve_pending(lease, SKU, limit=100, in_hand=[in_hand("gone", 2)]) == []

    assert snapshot(inventory_url) == before  # no stock change, reservation or record
    assert inventory.request_outcome("gone") == ended
    assert inventory.attempts("gone") == []

    # Beside a live request, only the live one is served.
    served = inventory.serve_pending(lease, SKU, limit=100, in_hand=[in_hand("gone", 2), in_hand("live", 1)])
    assert [(r.key, r.status) for r in served] == [("live", "reserved")]
    assert inventory.request_outcome("gone") == ended
    assert level(inventory, SKU) == (10, 1, 9)


def test_a_request_in_hand_whose_key_was_already_served_gets_no_new_outcome(
    inventory_url: str, inventory: Inventory, leases: LeaseManager
) -> None:
    inventory.add_sku(SKU, on_hand=10)
    lease = lease_for(leases, SKU)
    inventory.hand_off(SKU, 2, key="once")
    (first,) = inventory.serve_pending(lease, SKU, limit=100)
    assert first.status == "reserved"
    before = snapshot(inventory_url)

    # A redelivered copy handed to the server in memory after its listed copy was served.
    assert inventory.serve_pending(lease, SKU, limit=100, in_hand=[in_hand("once", 2)]) == []

    assert snapshot(inventory_url) == before
    assert level(inventory, SKU) == (10, 2, 8)
    assert inventory.request_outcome("once") == first
    assert [a.result for a in inventory.attempts("once")] == ["applied"]


def test_stock_runs_out_in_arrival_order_across_listed_and_in_hand(
    inventory: Inventory, leases: LeaseManager
) -> None:
    inventory.add_sku(SKU, on_hand=5)
    inventory.hand_off(SKU, 2, key="listed")
    hand = [in_hand("h-0", 2), in_hand("h-1", 2), in_hand("h-2", 1), in_hand("h-3", 1)]

    served = by_key(inventory.serve_pending(lease_for(leases, SKU), SKU, limit=100, in_hand=hand))

    assert {k: r.status for k, r in served.items()} == {
        "listed": "reserved",
        "h-0": "reserved",
        "h-1": "insufficient_stock",  # 1 left, 2 asked
        "h-2": "reserved",  # the unit h-1 could not take
        "h-3": "insufficient_stock",
    }
    assert [available_after(served[k]) for k in ("listed", "h-0", "h-2")] == [3, 1, 0]
    assert (served["h-1"].detail["available"], served["h-3"].detail["available"]) == (1, 0)
    assert level(inventory, SKU) == (5, 5, 0)
    assert sorted(r.quantity for r in inventory.reservations(SKU)) == [1, 2, 2]
    assert statuses(inventory, ["h-1", "h-3"]) == dict.fromkeys(["h-1", "h-3"], "insufficient_stock")
    assert [a.result for a in inventory.attempts("h-1")] == ["insufficient_stock"]
    assert inventory.invariant_violations() == []


@pytest.mark.parametrize(
    "bad",
    [in_hand("other-sku", 1, sku="COLD"), in_hand("zero", 0), in_hand("negative", -1)],
    ids=["another-sku", "zero-quantity", "negative-quantity"],
)
def test_invalid_requests_in_hand_are_refused_and_nothing_written(
    inventory_url: str, inventory: Inventory, leases: LeaseManager, bad: InHand
) -> None:
    inventory.add_sku(SKU, on_hand=10)
    inventory.add_sku("COLD", on_hand=10)
    inventory.hand_off(SKU, 1, key="listed")
    lease = lease_for(leases, SKU)
    before = snapshot(inventory_url)

    with pytest.raises(InvalidRequest) as refused:
        inventory.serve_pending(lease, SKU, limit=100, in_hand=[in_hand("valid", 1), bad])

    assert refused.value.field in {"in_hand", "quantity"}
    assert snapshot(inventory_url) == before
    assert inventory.pending_count(SKU) == 1
    assert statuses(inventory, ["listed", "valid", bad.key]) == dict.fromkeys(["listed", "valid", bad.key])
    # The lease is not spent by a refusal of its input: the same holder serves the valid ones.
    served = inventory.serve_pending(lease, SKU, limit=100, in_hand=[in_hand("valid", 1)])
    assert sorted((r.key, r.status) for r in served) == [("listed", "reserved"), ("valid", "reserved")]


@pytest.mark.parametrize(
    "bad",
    [
        in_hand("x" * 500),
        in_hand("two words"),  # a space belongs to an order line's reservation key only
        in_hand("expired-hold", hold_ms=-60_000),
        InHand(key="negative-epochs", sku=SKU, quantity=1, hold_ms=None, task_id=None, epochs=-1),
    ],
    ids=["key-too-long", "key-with-space", "negative-hold", "negative-epochs"],
)
def test_requests_in_hand_with_a_bad_key_hold_or_epochs_are_refused_as_hand_off_refuses_them(
    inventory_url: str, inventory: Inventory, leases: LeaseManager, bad: InHand
) -> None:
    inventory.add_sku(SKU, on_hand=10)
    lease = lease_for(leases, SKU)
    before = snapshot(inventory_url)

    with pytest.raises(InvalidRequest):
        inventory.serve_pending(lease, SKU, limit=100, in_hand=[bad])

    assert snapshot(inventory_url) == before


def test_a_request_in_hand_whose_key_was_applied_directly_is_replayed_not_applied_again(
    inventory: Inventory, leases: LeaseManager
) -> None:
    inventory.add_sku(SKU, on_hand=10)
    lease = lease_for(leases, SKU)
    direct = inventory.reserve(lease, SKU, 2, key="twice")

    (served,) = inventory.serve_pending(lease, SKU, limit=10, in_hand=[in_hand("twice", 2)])

    assert served.status == "reserved"
    assert served.detail["reservation_ids"] == [direct.reservation_id]
    assert [a.result for a in inventory.attempts("twice")] == ["replayed"]
    assert len(inventory.reservations(SKU)) == 1
    assert level(inventory, SKU) == (10, 2, 8)


def test_a_request_in_hand_for_an_unknown_sku_ends_invalid(
    inventory: Inventory, leases: LeaseManager
) -> None:
    (served,) = inventory.serve_pending(
        lease_for(leases, "GHOST"), "GHOST", limit=10, in_hand=[in_hand("ghost-1", sku="GHOST")]
    )
    assert (served.key, served.status, served.detail["error"]) == ("ghost-1", "invalid", "UnknownSku")
    assert inventory.reservations("GHOST") == []


def test_the_hand_takes_its_room_from_the_limit_and_the_oldest_listed_fill_the_rest(
    inventory: Inventory, leases: LeaseManager
) -> None:
    inventory.add_sku(SKU, on_hand=10)
    listed = [f"q-{i}" for i in range(5)]
    for key in listed:
        inventory.hand_off(SKU, 1, key=key)
    hand = [in_hand("h-0"), in_hand("h-1")]

    served = by_key(inventory.serve_pending(lease_for(leases, SKU), SKU, limit=4, in_hand=hand))

    assert sorted(served) == sorted([*listed[:2], "h-0", "h-1"])
    assert inventory.pending_count(SKU) == 3
    assert statuses(inventory, listed[2:]) == dict.fromkeys(listed[2:])


@pytest.mark.parametrize("quantity", [1, 50], ids=["would-reserve", "would-only-refuse"])
def test_a_stale_holders_batch_with_requests_in_hand_writes_nothing(
    inventory_url: str, inventory: Inventory, leases: LeaseManager, quantity: int
) -> None:
    """Holder A pauses past its lease; B takes over and writes. A's batch, with requests listed and in
    hand, must change nothing (not even end the requests whose quantity no stock would meet)."""
    inventory.add_sku(SKU, on_hand=10)
    old = lease_for(leases, SKU, holder="A")
    listed = [f"late-{i}" for i in range(2)]
    for key in listed:
        inventory.hand_off(SKU, quantity, key=key)
    hand = [in_hand(f"hand-{i}", quantity) for i in range(2)]
    keys = listed + [h.key for h in hand]
    leases.break_lease(scope_of(SKU), reason="A paused past its lease")
    new = lease_for(leases, SKU, holder="B")
    inventory.restock(new, SKU, 1, key="b-writes")
    before = snapshot(inventory_url)

    with pytest.raises(StaleToken) as stale:
        inventory.serve_pending(old, SKU, limit=10, in_hand=hand)

    assert (stale.value.presented, stale.value.highest) == (old.token, new.token)
    assert snapshot(inventory_url) == before
    assert inventory.pending_count(SKU) == 2
    assert statuses(inventory, keys) == dict.fromkeys(keys)
    assert all(inventory.attempts(key) == [] for key in keys)
    rejected = [h for h in inventory.history(SKU) if h.kind == "rejected"]
    assert [(h.token, h.highest_token, h.holder) for h in rejected] == [(old.token, new.token, "A")]
    with pytest.raises(LeaseLost):  # lost ownership is terminal: no second batch under that lease
        inventory.serve_pending(old, SKU, limit=10, in_hand=hand)
    assert snapshot(inventory_url) == before

    # The new holder serves what the stale one could not.
    served = by_key(inventory.serve_pending(new, SKU, limit=10, in_hand=hand))
    assert sorted(served) == sorted(keys)
    assert {r.status for r in served.values()} == ({"reserved"} if quantity == 1 else {"insufficient_stock"})
    assert inventory.invariant_violations() == []
