"""The chaos checker's business harm on a known history: a count decided from a stale read that overwrites
a delivery, a replenishment that orders on top of another past par, and stock that the accepted
operations (restocks, replenishments, counts' corrections) explain. Lease-only the harm is counted; with
the fence the same story is refused at the stock row and the checker finds nothing.
"""

from __future__ import annotations

import sqlalchemy as sa

from admin.chaos import Sent, check
from admin.chaos.checker import BUSINESS_HARM, business_harm
from fencing import Lease, LeaseManager, StaleToken
from fencing.engines import make_engine
from reservations import Inventory, Outcome, scope_of

PAR = 20


def _drop_fence_trigger(inventory_url: str) -> None:
    """Lease-only, as the chaos run's: the database's last guard goes with the fence."""
    engine = make_engine(inventory_url)
    with engine.begin() as conn:
        on = " ON stock" if engine.dialect.name == "postgresql" else ""
        conn.execute(sa.text(f"DROP TRIGGER stock_fence_never_lowers{on}"))
    engine.dispose()


def _story(inventory: Inventory, leases: LeaseManager, sent: dict[str, Sent]) -> list[str]:
    """Two holders whose leases ran out decide from reads that newer epochs overtook; returns the keys
    whose late write was refused."""

    def done(key: str, operation: str, kwargs: dict[str, object], outcome: Outcome, status: str) -> None:
        sent[key] = Sent(key, operation, {"sku": "S", **kwargs})
        inventory.record_outcome(key, operation, status, outcome.summary())

    def take(holder: str) -> Lease:
        leases.break_lease(scope_of("S"), reason="the holder paused past its lease")
        return leases.acquire(scope_of("S"), ttl=30, holder=holder)

    refused = []
    counter = leases.acquire(scope_of("S"), ttl=30, holder="counter")
    counted_from = inventory.look(counter, "S")  # 10 on hand; the counter pauses
    delivery = take("delivery")
    done("r-1", "restock", {"quantity": 5}, inventory.restock(delivery, "S", 5, key="r-1"), "restocked")
    try:  # one unit missing from the 10 it saw: it would set 9 and lose the delivery of 5
        figure = counted_from.on_hand - 1
        stale = inventory.count(counter, "S", figure, key="c-1", seen=counted_from, shrinkage=1)
        done("c-1", "count", {"shrinkage": 1}, stale, "counted")
    except StaleToken:
        refused.append("c-1")
    first = take("buyer-1")
    first_saw = inventory.look(first, "S")  # the first buyer reads, then pauses
    second = take("buyer-2")
    booked = inventory.replenish(second, "S", PAR, key="p-2", seen=inventory.look(second, "S"))
    done("p-2", "replenish", {"par": PAR}, booked, "replenished")
    try:  # the first buyer orders what it saw missing, on top of the second's order
        late = inventory.replenish(first, "S", PAR, key="p-1", seen=first_saw)
        done("p-1", "replenish", {"par": PAR}, late, "replenished")
    except StaleToken:
        refused.append("p-1")
    return refused


def test_lease_only_the_checker_counts_the_business_harm(inventory_url: str, leases: LeaseManager) -> None:
    _drop_fence_trigger(inventory_url)
    sent: dict[str, Sent] = {}
    with Inventory.from_url(inventory_url, enforce_fence=False) as inventory:
        inventory.add_sku("S", on_hand=10)
        assert _story(inventory, leases, sent) == []
        assert inventory.stock("S").on_hand == 9 + (PAR - 9) * 2  # 31: the delivery lost, par passed

    found = check(inventory_url, {"S": 10}, sent)
    assert [line.split(" (#")[0] for line in found["lost_updates"]] == [
        "S: count 'c-1'",
        "S: replenish 'p-1'",
    ]
    assert found["replenished_past_par"] == [
        "S: replenish 'p-1' ordered 11 for par 20 having seen 9 on hand, leaving 31"
    ]
    # Every unit is explained by an accepted operation: a count's correction is what it changed.
    assert (found["conservation"], found["oversells"], found["keys_applied_twice"]) == ([], [], [])
    assert found["writes_after_newer_token"]  # the audit's own view of the same writes
    assert business_harm(found) == 3
    assert set(BUSINESS_HARM) <= set(found)


def test_with_the_fence_the_same_story_is_refused_and_harmless(
    inventory_url: str, leases: LeaseManager
) -> None:
    sent: dict[str, Sent] = {}
    with Inventory.from_url(inventory_url) as inventory:
        inventory.add_sku("S", on_hand=10)
        assert _story(inventory, leases, sent) == ["c-1", "p-1"]
        assert inventory.stock("S").on_hand == PAR
    found = check(inventory_url, {"S": 10}, sent)
    assert {rule: lines for rule, lines in found.items() if lines} == {}
