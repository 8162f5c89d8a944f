"""The bound on fencing tokens, on every lease backend and database: no token past MAX_TOKEN is issued,
accepted by a fence or used to repair a coordinator, each refusal is a typed error that writes nothing,
and history stays readable when a stored token is not one.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from fencing import AsyncLeaseManager, InvalidLeaseRequest, Lease, StaleToken, TokenOverflow
from fencing.lease import MAX_TOKEN, new_lease_id
from fencing.redis_backend import REPAIR, Reply, scope_keys
from fencing.sql_backend import lease_events, leases
from testing.stores import REDIS_URL, Stack
from testing.support import Resource, items


def forged(scope: str, token: int) -> Lease:
    """A lease no coordinator issued: what a buggy or hostile caller can build by hand."""
    return Lease(scope, token, new_lease_id(), "forger", 5, time.monotonic())


def coordinator_state(stack: Stack, scope: str) -> Any:
    """Everything the lease backend holds for ``scope``, to prove a refusal wrote nothing."""
    if stack.lease_url.startswith("redis"):
        client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        keys = scope_keys(stack.prefix, scope)
        state = (client.get(keys.lease), client.hgetall(keys.state), client.lrange(keys.log, 0, -1))
        client.close()
        return state
    with Resource(stack.lease_url).engine.connect() as conn:
        return (
            conn.execute(sa.select(leases).where(leases.c.scope == scope)).all(),
            conn.execute(
                sa.select(lease_events).where(lease_events.c.scope == scope).order_by(lease_events.c.id)
            ).all(),
        )


def set_counter(stack: Stack, scope: str, value: int) -> None:
    """Fault injection: the coordinator's counter as a restored backup or an older version left it."""
    if stack.lease_url.startswith("redis"):
        client = redis.Redis.from_url(REDIS_URL)
        client.hset(scope_keys(stack.prefix, scope).state, "token", value)
        client.close()
    else:
        with Resource(stack.lease_url).engine.begin() as conn:
            conn.execute(sa.update(leases).where(leases.c.scope == scope).values(token=value))


def test_the_bound_survives_doubles_json_and_int64() -> None:
    assert float(MAX_TOKEN) == MAX_TOKEN and json.loads(json.dumps(float(MAX_TOKEN))) == MAX_TOKEN
    assert float(MAX_TOKEN + 2) != MAX_TOKEN + 2  # one past the bound a double is no longer exact
    assert MAX_TOKEN + 1 < 2**63 - 1  # a counter at the bound can always be compared and incremented


@pytest.mark.parametrize("token", [MAX_TOKEN + 1, 2**62, 2**63 - 1, 2**63, 2**64], ids=repr)
def test_a_token_past_the_bound_cannot_make_a_lease(token: int) -> None:
    with pytest.raises(TokenOverflow) as refused:
        forged("sku:A", token)
    assert isinstance(refused.value, InvalidLeaseRequest)
    assert refused.value.token == token and refused.value.limit == MAX_TOKEN
    assert forged("sku:A", MAX_TOKEN).token == MAX_TOKEN


def test_the_fence_refuses_an_altered_token_before_the_statement(stack: Stack, resource: Resource) -> None:
    resource.create("sku:A", quantity=10)
    lease = forged("sku:A", MAX_TOKEN)
    object.__setattr__(lease, "token", 2**63 - 1)  # a frozen dataclass is only frozen by convention
    with pytest.raises(TokenOverflow):
        resource.write(lease, "sku:A", -1)
    with pytest.raises(InvalidLeaseRequest):
        resource.write(None, "sku:A", -1)  # type: ignore[arg-type]
    assert resource.row("sku:A") == (10, 0, None)
    conn = resource.engine.connect()
    conn.close()  # any statement on this connection would fail with a database error
    with pytest.raises(TokenOverflow):
        resource.fence.update(conn, lease, scope="sku:A", where=[items.c.scope == "sku:A"], values={})


def test_a_forged_top_token_exhausts_the_scope_with_a_typed_error(
    stack: Stack, resource: Resource, caplog: pytest.LogCaptureFixture
) -> None:
    """The forged lease is accepted (its token is in range) and fences everyone out; the repair raises
    the counter exactly to the bound, and the next acquisition is refused instead of overflowing."""
    resource.create("sku:A", quantity=10)
    assert resource.write(forged("sku:A", MAX_TOKEN), "sku:A", -1).applied
    with stack.manager() as manager:
        with (
            caplog.at_level(logging.WARNING, logger="fencing"),
            pytest.raises(StaleToken) as stale,
            manager.hold("sku:A", ttl=5, holder="B") as behind,
        ):
            resource.write(behind, "sku:A", -1)
        assert stale.value.highest == MAX_TOKEN
        repaired = [r.getMessage() for r in caplog.records if "regression" in r.getMessage()]
        assert repaired and repaired[0].endswith(f"counter raised from {behind.token} to {MAX_TOKEN}")
        before = coordinator_state(stack, "sku:A")
        with pytest.raises(TokenOverflow) as exhausted:
            manager.acquire("sku:A", ttl=5, holder="C")
        assert exhausted.value.scope == "sku:A" and exhausted.value.token == MAX_TOKEN
        assert coordinator_state(stack, "sku:A") == before
        events = manager.history("sku:A")
    assert [(e.event, e.token) for e in events][-2:] == [("acquired", behind.token), ("repaired", MAX_TOKEN)]
    assert resource.row("sku:A")[:2] == (9, MAX_TOKEN)


@pytest.mark.parametrize("counter", [MAX_TOKEN, 2**63 - 1], ids=["at-the-bound", "int64-max"])
def test_a_counter_at_or_past_the_bound_issues_no_token(lease_stack: Stack, counter: int) -> None:
    with lease_stack.manager() as manager:
        manager.release(manager.acquire("sku:A", ttl=5, holder="A"))
        set_counter(lease_stack, "sku:A", counter)
        before = coordinator_state(lease_stack, "sku:A")
        with pytest.raises(TokenOverflow) as exhausted:
            manager.acquire("sku:A", ttl=5, holder="B")
        assert exhausted.value.token == counter
        assert coordinator_state(lease_stack, "sku:A") == before
        assert manager.current("sku:A") is None


def test_an_exhausted_counter_is_overflow_even_while_its_last_lease_is_held(lease_stack: Stack) -> None:
    """Not LeaseBusy: waiting for the holder would never help, on any backend."""
    with lease_stack.manager() as manager:
        manager.acquire("sku:A", ttl=30, holder="A")
        set_counter(lease_stack, "sku:A", MAX_TOKEN)
        before = coordinator_state(lease_stack, "sku:A")
        with pytest.raises(TokenOverflow):
            manager.acquire("sku:A", ttl=5, holder="B", wait=1)
        assert coordinator_state(lease_stack, "sku:A") == before
        info = manager.current("sku:A")
        assert info is not None and info.holder == "A"


def test_repair_past_the_bound_is_refused_and_changes_nothing(lease_stack: Stack) -> None:
    with lease_stack.manager() as manager:
        lease = manager.acquire("sku:A", ttl=5, holder="A")
        before = coordinator_state(lease_stack, "sku:A")
        for highest in (MAX_TOKEN + 1, 2**63 - 1):
            error = StaleToken(scope="sku:A", presented=lease.token, highest=highest)
            with pytest.raises(TokenOverflow):
                manager.handle_stale(lease, error)
            with pytest.raises(TokenOverflow):  # the backend's own check, below the manager's
                manager.executor.run(manager.core.repair(lease, highest))
        with pytest.raises(InvalidLeaseRequest):
            manager.handle_stale(lease, ValueError("not a rejection"))  # type: ignore[arg-type]
        assert coordinator_state(lease_stack, "sku:A") == before
        assert not lease.lost
        info = manager.current("sku:A")
        assert info is not None and info.token == lease.token


def test_the_repair_script_refuses_a_highest_token_past_the_bound(redis_prefix: str) -> None:
    """The script checks its argument itself, so no caller can push the counter out of range."""
    stack = Stack(name="redis", lease_url=REDIS_URL, db_url="", prefix=redis_prefix)
    with stack.manager() as manager:
        lease = manager.acquire("sku:A", ttl=5, holder="A")
        before = coordinator_state(stack, "sku:A")
        client = redis.Redis.from_url(REDIS_URL)
        script = client.register_script(REPAIR)
        keys = scope_keys(redis_prefix, "sku:A")
        for highest in (str(MAX_TOKEN + 1), str(2**63 - 1), "1e3", "-5", "9.2233720368547758e+18"):
            reply = script(keys=keys, args=(lease.lease_id, highest, 256, MAX_TOKEN))
            assert reply == [Reply.OUT_OF_RANGE], highest
        client.close()
        assert coordinator_state(stack, "sku:A") == before


def _inject_unreadable_events(stack: Stack, scope: str) -> None:
    if stack.lease_url.startswith("redis"):
        client = redis.Redis.from_url(REDIS_URL)
        log = scope_keys(stack.prefix, scope).log
        at = str(int(time.time() * 1000))
        for entry in (
            ["repaired", "9.2233720368547758e+18", at, "", "old", "", "", "", ""],
            ["acquired", "abc", at, "", "", "", "", "", ""],
            ["", "7", at, "", "", "", "", "", ""],  # no event name
            ["acquired", "7", at],  # too few fields
            ["acquired", "7", "yesterday", "", "", "", "", "", ""],  # no time
            ["released", "2", at, "", "", "1.5", "", "", ""],
        ):
            client.lpush(log, "\t".join(entry))
        client.lpush(log, "not an entry")
        client.close()
        return
    with Resource(stack.lease_url).engine.begin() as conn:
        for token in (2**63 - 1, -1, 2):
            conn.execute(
                sa.insert(lease_events).values(
                    scope=scope, event="released", token=token, at_ms=int(time.time() * 1000)
                )
            )


def test_history_skips_entries_whose_token_is_not_one(
    lease_stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    with lease_stack.manager() as manager:
        manager.release(manager.acquire("sku:A", ttl=5, holder="A"))
        _inject_unreadable_events(lease_stack, "sku:A")
        with caplog.at_level(logging.WARNING, logger="fencing"):
            events = manager.history("sku:A")
    assert [(e.event, e.token) for e in events] == [("acquired", 1), ("released", 1), ("released", 2)]
    assert events[-1].previous_token is None
    assert sum("skipped" in r.getMessage() for r in caplog.records) >= 2


async def test_the_async_manager_refuses_the_same_tokens(lease_stack: Stack) -> None:
    manager: AsyncLeaseManager = await lease_stack.async_manager()
    try:
        lease = await manager.acquire("sku:A", ttl=5, holder="A")
        with pytest.raises(TokenOverflow):
            await manager.handle_stale(
                lease, StaleToken(scope="sku:A", presented=lease.token, highest=2**63 - 1)
            )
        await manager.release(lease)
        set_counter(lease_stack, "sku:A", MAX_TOKEN)
        with pytest.raises(TokenOverflow):
            await manager.acquire("sku:A", ttl=5, holder="B")
        assert await manager.current("sku:A") is None
    finally:
        await manager.close()
