"""The fence guard on every lease backend and database: stale epochs are refused in the write itself,
a refusal is told apart from the write's own condition, lost is sticky, and a coordinator that went
backwards is repaired instead of stalling the scope.
"""

from __future__ import annotations

import logging
import time

import pytest
import redis
import sqlalchemy as sa

from fencing import (
    FenceOutcome,
    Lease,
    LeaseLost,
    LeaseManager,
    ScopeMismatch,
    StaleToken,
)
from fencing.engines import make_async_engine
from fencing.redis_backend import scope_keys
from fencing.sql_backend import leases
from testing.stores import REDIS_URL, Stack
from testing.support import Resource, items


def test_current_lease_writes_and_sets_the_fence(stack: Stack, resource: Resource) -> None:
    resource.create("sku:A", quantity=10)
    with stack.manager() as manager:
        lease = manager.acquire("sku:A", ttl=5, holder="A")
        result = resource.write(lease, "sku:A", -3)
    assert result.applied and result.row is not None and result.row[0] == 7
    assert resource.row("sku:A") == (7, lease.token, lease.lease_id)


def test_seed_timeline_late_write_from_expired_owner_is_rejected(stack: Stack, resource: Resource) -> None:
    resource.create("sku:WIDGET", quantity=10)
    with stack.manager() as manager:
        a = manager.acquire("sku:WIDGET", ttl=5, holder="A")
        manager.break_lease("sku:WIDGET", reason="A paused past its lease")  # A's lease is gone
        b = manager.acquire("sku:WIDGET", ttl=5, holder="B")
        assert b.token == a.token + 1
        assert resource.write(b, "sku:WIDGET", -2).applied
        with pytest.raises(StaleToken) as stale:
            resource.write(a, "sku:WIDGET", -5)  # A wakes and its delayed write arrives
    assert (stale.value.presented, stale.value.highest) == (a.token, b.token)
    assert stale.value.scope == "sku:WIDGET" and stale.value.holder == "A"
    assert a.lost
    assert resource.row("sku:WIDGET") == (8, b.token, b.lease_id)
    assert resource.log("sku:WIDGET") == [(b.token, b.lease_id, -2)]


def test_older_epoch_that_never_wrote_is_still_refused_after_a_newer_write(
    stack: Stack, resource: Resource
) -> None:
    resource.create("sku:A")
    with stack.manager() as manager:
        # Broken, not released: the holders never learn their leases ended, so their writes reach the row.
        a = manager.acquire("sku:A", ttl=5, holder="A")
        manager.break_lease("sku:A", reason="A expired")
        b = manager.acquire("sku:A", ttl=5, holder="B")
        manager.break_lease("sku:A", reason="B expired")
        c = manager.acquire("sku:A", ttl=5, holder="C")
        assert resource.write(c, "sku:A", -1).applied
        for old in (a, b):
            with pytest.raises(StaleToken):
                resource.write(old, "sku:A", -1)
    assert [token for token, _, _ in resource.log("sku:A")] == [c.token]


def test_same_token_from_another_lease_is_refused(stack: Stack, resource: Resource) -> None:
    """Two leases handed the same number (a coordinator that lost its counter) cannot both write."""
    resource.create("sku:A")
    with stack.manager() as manager:
        first = manager.acquire("sku:A", ttl=5, holder="A")
        assert resource.write(first, "sku:A", -1).applied
        twin = Lease("sku:A", first.token, "f" * 32, "B", 5, time.monotonic())
        with pytest.raises(StaleToken) as stale:
            resource.write(twin, "sku:A", -1)
        assert stale.value.highest == first.token
        assert resource.write(first, "sku:A", -1).applied  # the epoch that wrote first keeps writing
    assert resource.row("sku:A")[0] == 98


def test_failed_condition_is_not_a_stale_token(stack: Stack, resource: Resource) -> None:
    resource.create("sku:A", quantity=2)
    with stack.manager() as manager:
        lease = manager.acquire("sku:A", ttl=5, holder="A")
        result = resource.write(lease, "sku:A", -3)
        assert result.outcome is FenceOutcome.CONDITION_FAILED
        assert not lease.lost
        assert resource.write(lease, "sku:A", -2).applied
    assert resource.row("sku:A")[0] == 0


def test_missing_row_is_reported(stack: Stack, resource: Resource) -> None:
    resource.create("sku:A")
    with stack.manager() as manager:
        lease = manager.acquire("sku:B", ttl=5, holder="A")
        assert resource.write(lease, "sku:B", -1).outcome is FenceOutcome.NO_ROW


def test_a_scope_token_never_fences_another_scope(stack: Stack, resource: Resource) -> None:
    resource.create("sku:A", "sku:B")
    with stack.manager() as manager:
        for _ in range(3):  # move sku:A well ahead of sku:B
            manager.release(manager.acquire("sku:A", ttl=5, holder="A"))
        a = manager.acquire("sku:A", ttl=5, holder="A")
        b = manager.acquire("sku:B", ttl=5, holder="B")
        assert a.token > b.token
        assert resource.write(a, "sku:A", -1).applied
        assert resource.write(b, "sku:B", -1).applied
        with pytest.raises(ScopeMismatch):
            resource.write(a, "sku:B", -1)
    assert resource.row("sku:B") == (99, b.token, b.lease_id)


def test_lost_lease_is_refused_without_a_round_trip(stack: Stack, resource: Resource) -> None:
    resource.create("sku:A")
    with stack.manager() as manager:
        a = manager.acquire("sku:A", ttl=5, holder="A")
        manager.break_lease("sku:A", reason="test")
        b = manager.acquire("sku:A", ttl=5, holder="B")
        assert resource.write(b, "sku:A", -1).applied
        with pytest.raises(StaleToken):
            resource.write(a, "sku:A", -1)
    conn = resource.engine.connect()
    conn.close()  # any statement on this connection would fail with a database error
    with pytest.raises(LeaseLost):
        resource.fence.update(
            conn, a, scope="sku:A", where=[items.c.scope == "sku:A"], values={"quantity": 0}
        )


def test_switched_off_fence_lets_the_stale_write_through(stack: Stack) -> None:
    """The control for every test above: without the token condition the late write lands."""
    unfenced = Resource(stack.db_url, enforce=False).create("sku:A", quantity=10)
    with stack.manager() as manager:
        a = manager.acquire("sku:A", ttl=5, holder="A")
        manager.break_lease("sku:A", reason="A paused")
        b = manager.acquire("sku:A", ttl=5, holder="B")
        assert unfenced.write(b, "sku:A", -2).applied
        assert unfenced.write(a, "sku:A", -5).applied
    assert [t for t, _, _ in unfenced.log("sku:A")] == [b.token, a.token]
    unfenced.close()


def _regress_coordinator(stack: Stack, scope: str) -> None:
    """Fault injection: the coordinator forgets its counter (Redis data loss, a restored backup)."""
    if stack.lease_url.startswith("redis"):
        client = redis.Redis.from_url(REDIS_URL)
        client.hset(scope_keys(stack.prefix, scope).state, "token", 0)
        client.close()
    else:
        with Resource(stack.lease_url).engine.begin() as conn:
            conn.execute(sa.update(leases).where(leases.c.scope == scope).values(token=0))


def test_regressed_coordinator_is_repaired_and_the_scope_progresses(
    stack: Stack, resource: Resource, caplog: pytest.LogCaptureFixture
) -> None:
    resource.create("sku:A")
    with stack.manager() as manager:
        for _ in range(3):
            lease = manager.acquire("sku:A", ttl=5, holder="A")
            assert resource.write(lease, "sku:A", -1).applied
            manager.release(lease)
        highest = resource.row("sku:A")[1]
        _regress_coordinator(stack, "sku:A")
        with (
            caplog.at_level(logging.WARNING, logger="fencing"),
            pytest.raises(StaleToken),
            manager.hold("sku:A", ttl=5, holder="B") as behind,
        ):
            assert behind.token <= highest
            resource.write(behind, "sku:A", -1)
        assert behind.lost
        assert any("regression" in r.message and str(highest) in r.message for r in caplog.records)
        after = manager.acquire("sku:A", ttl=5, holder="C")
        assert after.token > highest
        assert resource.write(after, "sku:A", -1).applied
    tokens = [t for t, _, _ in resource.log("sku:A")]
    assert tokens == sorted(tokens) and len(tokens) == 4


def test_ordinary_lost_race_is_not_mistaken_for_regression(stack: Stack, resource: Resource) -> None:
    resource.create("sku:A")
    with stack.manager() as manager:
        a = manager.acquire("sku:A", ttl=5, holder="A")
        manager.break_lease("sku:A", reason="A paused")
        b = manager.acquire("sku:A", ttl=5, holder="B")
        assert resource.write(b, "sku:A", -1).applied
        with pytest.raises(StaleToken) as stale:
            resource.write(a, "sku:A", -1)
        assert manager.handle_stale(a, stale.value) is False
        info = manager.current("sku:A")
        assert info is not None and info.token == b.token  # B's epoch is untouched


async def test_async_guarded_write_refuses_stale_epochs(stack: Stack, resource: Resource) -> None:
    resource.create("sku:A", quantity=5)
    manager = await stack.async_manager()
    engine = make_async_engine(stack.db_url)
    try:
        a = await manager.acquire("sku:A", ttl=5, holder="A")
        await manager.break_lease("sku:A", reason="A paused")
        b = await manager.acquire("sku:A", ttl=5, holder="B")
        write = {
            "scope": "sku:A",
            "where": [items.c.scope == "sku:A"],
            "values": {"quantity": items.c.quantity - 1},
        }
        async with engine.begin() as conn:
            assert (await resource.fence.update_async(conn, b, **write)).applied
        async with engine.begin() as conn:
            with pytest.raises(StaleToken):
                await resource.fence.update_async(conn, a, **write)
    finally:
        await manager.close()
        await engine.dispose()
    assert resource.row("sku:A") == (4, b.token, b.lease_id)


def test_lease_manager_works_without_the_test_stack(tmp_path: object) -> None:
    """The README's minimal use, on a plain SQLite file."""
    url = f"sqlite:///{tmp_path}/plain.sqlite3"
    with LeaseManager.from_url(url) as manager:
        manager.create_schema()
        with manager.hold("sku:A", ttl=5, holder="me") as lease:
            assert lease.token == 1
        assert manager.current("sku:A") is None
