"""Redis coordinator faults against a real, private redis-server: data loss on restart and outage.

A restart without persistence resets the token counter; these tests show the fence still lets at most one
lease write per token, rejects old epochs, and that the stale-token repair gets the scope moving again.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from fencing import AsyncLeaseManager, BackendUnavailable, Lease, LeaseLost, LeaseManager, StaleToken
from testing.harness import wait_until
from testing.redis_servers import RedisServer, redis_server
from testing.support import Resource

SCOPE = "sku-A"
PREFIX = "faults"
TTL = 30.0  # far longer than any test: nothing here may expire on its own


def restart_wiped(server: RedisServer) -> None:
    """Kill -9 and start again on the same port: a crash without persistence, so all data is lost."""
    server.kill()
    shutil.rmtree(server.folder)  # belt and braces: nothing on disk to reload either
    server.start()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as running:
        yield running


@pytest.fixture
def manager(server: RedisServer) -> Iterator[LeaseManager]:
    # Short socket timeouts keep the outage test quick; a refused connection fails at once anyway.
    url = server.url()
    with LeaseManager.from_url(url, prefix=PREFIX, socket_connect_timeout=1, socket_timeout=1) as mgr:
        yield mgr


@pytest.fixture(params=["postgresql", "sqlite"])
def protected(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Resource]:
    """The protected rows, on PostgreSQL or on a SQLite file: the fence must hold on both."""
    url = (
        request.getfixturevalue("pg_url")
        if request.param == "postgresql"
        else f"sqlite:///{tmp_path / 'resource.sqlite3'}"
    )
    res = Resource(url).create(SCOPE, quantity=100)
    try:
        yield res
    finally:
        res.close()


def write_epoch(manager: LeaseManager, resource: Resource, *, release: bool = True) -> Lease:
    lease = manager.acquire(SCOPE, ttl=TTL, holder="before-restart")
    assert resource.write(lease, SCOPE, -1).applied
    if release:
        # Ended at the coordinator without the holder noticing (an expiry): a released lease would
        # refuse its own late writes locally and never show the fence at work.
        manager.break_lease(SCOPE, reason="epoch ended")
    return lease


def burn_tokens(manager: LeaseManager, count: int) -> None:
    """Move the coordinator's counter forward without writing anything."""
    for _ in range(count):
        manager.release(manager.acquire(SCOPE, ttl=TTL, holder="burner"))


def assert_rejected(resource: Resource, lease: Lease, *, highest: int) -> None:
    with pytest.raises(StaleToken) as caught:
        resource.write(lease, SCOPE, -1)
    assert (caught.value.presented, caught.value.highest) == (lease.token, highest)
    assert lease.lost


def test_wiped_restart_regresses_the_counter_but_the_fence_holds(
    server: RedisServer, manager: LeaseManager, protected: Resource
) -> None:
    old1, old2 = write_epoch(manager, protected), write_epoch(manager, protected)
    # The third holder keeps its lease across the restart, as if paused while the server died.
    old3 = write_epoch(manager, protected, release=False)
    assert protected.row(SCOPE)[1:] == (3, old3.lease_id)

    restart_wiped(server)
    assert manager.current(SCOPE) is None
    assert manager.history(SCOPE) == []

    # (a) The coordinator starts counting again: it hands out tokens the resource has already seen.
    new1 = manager.acquire(SCOPE, ttl=TTL, holder="after-restart")
    assert new1.token == 1 <= protected.row(SCOPE)[1]
    assert_rejected(protected, new1, highest=3)
    manager.release(new1)  # the fence marked it lost; the coordinator still needs telling

    burn_tokens(manager, 1)
    new3 = manager.acquire(SCOPE, ttl=TTL, holder="after-restart")
    assert new3.token == old3.token == 3

    # (b) Two live leases share token 3: only the one whose id the row carries may write.
    assert_rejected(protected, new3, highest=3)
    assert protected.write(old3, SCOPE, -1).applied

    # (c) Epochs that ended before the restart stay fenced off, whatever the coordinator forgot.
    assert_rejected(protected, old1, highest=3)
    assert_rejected(protected, old2, highest=3)

    assert [(token, lease_id) for token, lease_id, _ in protected.log(SCOPE)] == [
        (1, old1.lease_id),
        (2, old2.lease_id),
        (3, old3.lease_id),
        (3, old3.lease_id),
    ]
    assert protected.row(SCOPE) == (96, 3, old3.lease_id)


@pytest.mark.parametrize("first", ["old holder", "new holder"])
def test_two_leases_with_the_same_token_never_both_write(
    server: RedisServer, manager: LeaseManager, protected: Resource, first: str
) -> None:
    write_epoch(manager, protected)
    write_epoch(manager, protected)
    # Token 3 is handed out before the restart but not yet used, so neither copy has an advantage.
    old3 = manager.acquire(SCOPE, ttl=TTL, holder="before-restart")

    restart_wiped(server)
    burn_tokens(manager, 2)
    new3 = manager.acquire(SCOPE, ttl=TTL, holder="after-restart")
    assert new3.token == old3.token == 3
    assert new3.lease_id != old3.lease_id

    winner, loser = (old3, new3) if first == "old holder" else (new3, old3)
    assert protected.write(winner, SCOPE, -1).applied
    assert_rejected(protected, loser, highest=3)
    assert [(t, lid) for t, lid, _ in protected.log(SCOPE)][-1] == (3, winner.lease_id)
    assert [t for t, _, _ in protected.log(SCOPE)].count(3) == 1


def repair_directly(manager: LeaseManager, resource: Resource) -> None:
    lease = manager.acquire(SCOPE, ttl=TTL, holder="after-restart")
    with pytest.raises(StaleToken) as caught:
        resource.write(lease, SCOPE, -1)
    assert manager.handle_stale(lease, caught.value) is True


def repair_through_hold(manager: LeaseManager, resource: Resource) -> None:
    # The StaleToken leaving the block is what makes hold() run the repair.
    with pytest.raises(StaleToken), manager.hold(SCOPE, ttl=TTL, holder="after-restart") as lease:
        resource.write(lease, SCOPE, -1)


@pytest.mark.parametrize("burned", [0, 2], ids=["token below highest", "token equal to highest"])
@pytest.mark.parametrize("repair", [repair_directly, repair_through_hold], ids=["direct", "hold"])
def test_stale_rejection_of_the_current_holder_repairs_the_counter(
    server: RedisServer,
    manager: LeaseManager,
    protected: Resource,
    caplog: pytest.LogCaptureFixture,
    burned: int,
    repair: Callable[[LeaseManager, Resource], None],
) -> None:
    stale_epochs = [write_epoch(manager, protected) for _ in range(3)]
    restart_wiped(server)
    burn_tokens(manager, burned)

    with caplog.at_level(logging.WARNING, logger="fencing"):
        repair(manager, protected)

    warnings = [
        r
        for r in caplog.records
        if r.name == "fencing" and r.levelno == logging.WARNING and "regression" in r.getMessage()
    ]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert SCOPE in message
    # Both sides of the regression are named: the token the coordinator issued and the resource's.
    numbers = set(re.findall(r"\b\d+\b", message.replace(SCOPE, "")))
    assert {str(burned + 1), "3"} <= numbers
    # The repair ends the lease whose token can never write, so nobody waits out its ttl.
    assert manager.current(SCOPE) is None
    assert [e.event for e in manager.history(SCOPE)][-1] == "repaired"

    after = manager.acquire(SCOPE, ttl=TTL, holder="after-repair")
    assert after.token > 3
    assert protected.write(after, SCOPE, -1).applied
    manager.release(after)
    assert protected.row(SCOPE)[1:] == (after.token, after.lease_id)

    # A lease that merely lost an ordinary race proves nothing about the counter: no repair.
    caplog.clear()
    with pytest.raises(StaleToken) as caught:
        protected.write(stale_epochs[0], SCOPE, -1)
    assert manager.handle_stale(stale_epochs[0], caught.value) is False
    assert not [r for r in caplog.records if "regression" in r.getMessage()]
    assert [t for t, _, _ in protected.log(SCOPE)] == [1, 2, 3, after.token]


def test_redis_down_raises_backend_unavailable_and_nothing_is_written(
    server: RedisServer, manager: LeaseManager, protected: Resource
) -> None:
    server.kill()
    with pytest.raises(BackendUnavailable) as caught:
        manager.acquire(SCOPE, ttl=TTL, holder="during-outage")
    assert caught.value.backend == "redis"
    # wait= is for a busy scope: an unreachable coordinator is reported, not waited out as busy.
    started = time.monotonic()
    with pytest.raises(BackendUnavailable):
        manager.acquire(SCOPE, ttl=TTL, holder="during-outage", wait=5)
    assert time.monotonic() - started < 5
    assert protected.row(SCOPE) == (100, 0, None)
    assert protected.log(SCOPE) == []


# A lease held while Redis stops answering (alive, CLIENT PAUSE) for less or more than its ttl, through a
# client that gives up on each call after 0.2 s.
STALL_TTL = 1.2
STALLS = [pytest.param(0.6, id="shorter than the ttl"), pytest.param(2.0, id="longer than the ttl")]
QUICK_CLIENT = {"socket_connect_timeout": 0.2, "socket_timeout": 0.2}


@pytest.fixture
def sqlite_resource(tmp_path: Path) -> Iterator[Resource]:
    res = Resource(f"sqlite:///{tmp_path / 'resource.sqlite3'}").create(SCOPE, quantity=100)
    try:
        yield res
    finally:
        res.close()


def pause(server: RedisServer, seconds: float) -> float:
    """Redis stops answering every client for ``seconds``; returns when it answers again (monotonic)."""
    admin = redis.Redis.from_url(server.url())
    try:
        admin.execute_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")
    finally:
        admin.close()
    return time.monotonic() + seconds


def settle(lease: Lease, stall_ends: float) -> float | None:
    """Wait until the stall is decided for ``lease``: renewed after it (None), or lost (the time it had
    left on its local clock when seen lost)."""

    def decided() -> tuple[float | None] | None:
        if lease.lost:
            return (lease.time_left(),)
        if time.monotonic() > stall_ends and lease.time_left() > STALL_TTL - 0.5:
            return (None,)
        return None

    return wait_until(decided, timeout=10, what="the lease to be renewed after the stall, or lost")[0]


def held_after_stall(lease: Lease, left: float | None, stall: float, resource: Resource) -> bool:
    """A stall shorter than the ttl costs no lease: it is still the holder's and its write applies. A
    longer one loses it, and only once its local time has nearly run out, so writes went on meanwhile."""
    if stall < STALL_TTL:
        assert left is None, lease.lost_reason
        assert resource.write(lease, SCOPE, -1).applied
        return True
    assert left is not None and left < STALL_TTL / 4
    assert (lease.lost_reason or "").startswith("renewal failed: redis unavailable")
    with pytest.raises(LeaseLost):
        resource.write(lease, SCOPE, -1)
    return False


@pytest.mark.parametrize("stall", STALLS)
def test_a_stall_costs_a_hold_its_lease_only_past_the_ttl(
    server: RedisServer, sqlite_resource: Resource, stall: float
) -> None:
    with (
        LeaseManager.from_url(server.url(), prefix=PREFIX, **QUICK_CLIENT) as mgr,
        mgr.hold(SCOPE, ttl=STALL_TTL, holder="stalled") as lease,
    ):
        left = settle(lease, pause(server, stall))
        if held_after_stall(lease, left, stall, sqlite_resource):
            assert mgr.renew(lease).token == lease.token


@pytest.mark.parametrize("stall", STALLS)
async def test_a_stall_costs_an_async_hold_its_lease_only_past_the_ttl(
    server: RedisServer, sqlite_resource: Resource, stall: float
) -> None:
    async with (
        AsyncLeaseManager.from_url(server.url(), prefix=PREFIX, **QUICK_CLIENT) as mgr,
        mgr.hold(SCOPE, ttl=STALL_TTL, holder="stalled") as lease,
    ):
        # Waited for on a thread: the renewal task needs this loop meanwhile.
        left = await asyncio.to_thread(settle, lease, pause(server, stall))
        if held_after_stall(lease, left, stall, sqlite_resource):
            assert (await mgr.renew(lease)).token == lease.token
