"""Lease rules on every backend: token order, renewal, identity-checked release, expiry, history, holds,
and the typed refusal of bad input. Each test runs against Redis, SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio
import sqlalchemy as sa

from fencing import (
    AsyncLeaseManager,
    InvalidLeaseRequest,
    Lease,
    LeaseBusy,
    LeaseLost,
    LeaseManager,
)
from fencing.engines import make_engine
from fencing.lease import new_lease_id
from fencing.manager import DEFAULT_HISTORY_CAP, DEFAULT_HISTORY_RETENTION, MAX_SCOPES_READ, retry_renewal
from fencing.plan import Bound, Command, Op, Plan, ScriptCall, run_sync
from fencing.redis_backend import scope_keys
from fencing.redis_executor import AsyncRedisExecutor, SyncRedisExecutor, outage
from fencing.sql import SyncSqlExecutor, execute
from testing.harness import wait_until
from testing.stores import REDIS_URL, Stack

# The deadline of every poll here: each waits only for a lease's short ttl to pass, on the coordinator's
# clock or on ours.
WAIT = 5.0


def test_tokens_strictly_increase_across_acquisitions(manager: LeaseManager) -> None:
    tokens = []
    for _ in range(5):
        lease = manager.acquire("sku:A", ttl=5, holder="w1")
        tokens.append(lease.token)
        manager.release(lease)
    assert tokens == sorted(set(tokens)) and len(tokens) == 5


def test_busy_scope_names_holder_and_retry_after(manager: LeaseManager) -> None:
    first = manager.acquire("sku:A", ttl=5, holder="host-1:11:task-a")
    with pytest.raises(LeaseBusy) as busy:
        manager.acquire("sku:A", ttl=5, holder="host-2:22:task-b")
    assert busy.value.holder == "host-1:11:task-a"
    assert busy.value.token == first.token
    assert 0 < busy.value.retry_after <= 5


def test_renewal_keeps_the_token_and_extends_the_lease(manager: LeaseManager) -> None:
    lease = manager.acquire("sku:A", ttl=0.5, holder="w1")
    before = lease.expires_at
    renewed = manager.renew(lease)
    assert renewed.token == lease.token
    assert renewed.expires_at >= before
    info = manager.current("sku:A")
    assert info is not None and info.token == lease.token and info.holder == "w1"


def test_scopes_are_independent(manager: LeaseManager) -> None:
    a1 = manager.acquire("sku:A", ttl=5, holder="w1")
    b1 = manager.acquire("sku:B", ttl=5, holder="w2")  # not blocked by A's lease
    manager.release(a1)
    a2 = manager.acquire("sku:A", ttl=5, holder="w1")
    assert a2.token == a1.token + 1
    assert manager.current("sku:B") is not None and b1.token == 1


def test_expired_lease_is_superseded_and_cannot_renew_or_release(manager: LeaseManager) -> None:
    old = manager.acquire("sku:A", ttl=0.1, holder="A")
    wait_until(lambda: manager.current("sku:A") is None, timeout=WAIT, what="the lease to expire")
    new = manager.acquire("sku:A", ttl=5, holder="B")
    assert new.token > old.token
    with pytest.raises(LeaseLost) as lost:
        manager.renew(old)
    assert "superseded" in lost.value.reason
    assert old.lost
    with pytest.raises(LeaseLost):
        manager.release(old)
    info = manager.current("sku:A")
    assert info is not None and info.holder == "B"  # the stale holder deleted nothing


def test_release_is_by_lease_id_only(manager: LeaseManager) -> None:
    lease = manager.acquire("sku:A", ttl=5, holder="A")
    forged = Lease("sku:A", lease.token, "0" * 32, "A", 5, time.monotonic())
    with pytest.raises(LeaseLost):
        manager.release(forged)
    with pytest.raises(LeaseLost):
        manager.renew(forged)
    info = manager.current("sku:A")
    assert info is not None and info.token == lease.token
    manager.release(lease)
    assert manager.current("sku:A") is None


def test_the_live_leases_of_many_scopes_are_read_at_once(manager: LeaseManager) -> None:
    held = {scope: manager.acquire(scope, ttl=5, holder=f"w-{scope}") for scope in ("sku:A", "sku:C")}
    released = manager.acquire("sku:B", ttl=5, holder="w-B")
    manager.release(released)
    broken = manager.acquire("sku:D", ttl=5, holder="w-D")
    manager.break_lease("sku:D", reason="operator")
    scopes = ["sku:A", "sku:B", "sku:C", "sku:D", *(f"sku:idle-{n}" for n in range(300))]
    found = manager.current_many(scopes)
    assert {scope: (info.token, info.holder) for scope, info in found.items()} == {
        scope: (lease.token, lease.holder) for scope, lease in held.items()
    }
    assert all(0 < info.time_left <= 5 for info in found.values())
    assert broken.scope not in found
    with pytest.raises(InvalidLeaseRequest):
        manager.current_many(["sku:A", "bad\nscope"])
    with pytest.raises(InvalidLeaseRequest):
        manager.current_many([])
    with pytest.raises(InvalidLeaseRequest):
        manager.current_many([f"sku:{n}" for n in range(MAX_SCOPES_READ + 1)])


async def test_the_async_shell_reads_many_scopes_at_once_too(async_manager: AsyncLeaseManager) -> None:
    lease = await async_manager.acquire("sku:A", ttl=5, holder="w1")
    found = await async_manager.current_many(["sku:A", "sku:B"])
    assert list(found) == ["sku:A"] and found["sku:A"].token == lease.token


def test_lost_lease_is_sticky(manager: LeaseManager) -> None:
    lease = manager.acquire("sku:A", ttl=5, holder="A")
    manager.break_lease("sku:A", reason="operator")
    with pytest.raises(LeaseLost):
        manager.renew(lease)
    # The scope is free and a new epoch can start, but the lost lease never comes back.
    fresh = manager.acquire("sku:A", ttl=5, holder="B")
    with pytest.raises(LeaseLost):
        manager.renew(lease)
    assert fresh.token == lease.token + 1


def test_history_records_epochs_and_how_they_ended(manager: LeaseManager) -> None:
    a = manager.acquire("sku:A", ttl=0.1, holder="A")
    wait_until(lambda: manager.current("sku:A") is None, timeout=WAIT, what="the lease to expire")
    b = manager.acquire("sku:A", ttl=5, holder="B")
    manager.release(b)
    c = manager.acquire("sku:A", ttl=5, holder="C")
    manager.break_lease("sku:A", reason="stuck worker")
    events = [(e.event, e.token, e.holder, e.previous_end) for e in manager.history("sku:A")]
    assert events == [
        ("acquired", a.token, "A", None),
        ("acquired", b.token, "B", "expired"),
        ("released", b.token, "B", None),
        ("acquired", c.token, "C", "released"),
        ("broken", c.token, "C", None),
    ]
    assert manager.history("sku:A", limit=2)[-1].event == "broken"
    assert manager.history("sku:never") == []


def test_acquire_with_wait_takes_the_lease_when_it_frees(manager: LeaseManager) -> None:
    first = manager.acquire("sku:A", ttl=0.2, holder="A")
    second = manager.acquire("sku:A", ttl=5, holder="B", wait=5)
    assert second.token == first.token + 1


def test_the_release_says_whether_another_acquirer_was_turned_away(manager: LeaseManager) -> None:
    quiet = manager.acquire("sku:A", ttl=5, holder="A")
    assert quiet.contended is None  # not known before the release
    manager.release(quiet)
    assert quiet.contended is False

    wanted = manager.acquire("sku:A", ttl=5, holder="A")
    with pytest.raises(LeaseBusy):
        manager.acquire("sku:A", ttl=5, holder="B")
    manager.release(wanted)
    assert wanted.contended is True

    # The mark belongs to one epoch: the next holder starts uncontended.
    with manager.hold("sku:A", ttl=5, holder="C") as after:
        pass
    assert after.contended is False


async def test_async_release_says_whether_another_acquirer_was_turned_away(
    async_manager: AsyncLeaseManager,
) -> None:
    async with async_manager.hold("sku:A", ttl=5, holder="A") as wanted:
        with pytest.raises(LeaseBusy):
            await async_manager.acquire("sku:A", ttl=5, holder="B")
    assert wanted.contended is True
    async with async_manager.hold("sku:A", ttl=5, holder="C") as quiet:
        pass
    assert quiet.contended is False


def test_hold_renews_past_the_ttl_and_releases(manager: LeaseManager) -> None:
    # A ttl long enough for a SQLite write transaction to get through on a loaded machine.
    with manager.hold("sku:A", ttl=0.6, holder="A", renew_every=0.1) as lease:
        deadline = lease.expires_at + 0.6
        # Outlive the original ttl on the local clock while the background renewal keeps it alive.
        wait_until(lambda: time.monotonic() > deadline, timeout=WAIT, what="twice the ttl to pass")
        info = manager.current("sku:A")
        assert info is not None and info.token == lease.token
        assert not lease.lost
    assert manager.current("sku:A") is None


def test_one_renewer_thread_keeps_every_hold_of_a_manager_alive(manager: LeaseManager) -> None:
    def renewers() -> int:
        return sum(1 for t in threading.enumerate() if t.name == "lease-renewer" and t.is_alive())

    before = renewers()
    ready, done = threading.Barrier(5), threading.Event()
    outlived: list[bool] = []

    def hold(scope: str) -> None:
        # A ttl that a loaded machine's SQLite write transactions (four holders and the renewer) get
        # through: only the renewals keep each hold past twice the ttl.
        with manager.hold(scope, ttl=1.0, holder=scope, renew_every=0.1) as lease:
            ready.wait(10)
            deadline = lease.acquired_at + 2.0
            wait_until(lambda: time.monotonic() > deadline, timeout=WAIT, what="twice the ttl to pass")
            info = manager.current(scope)
            outlived.append(info is not None and info.token == lease.token and not lease.lost)
            done.wait(10)

    holders = [threading.Thread(target=hold, args=(f"sku:R{i}",)) for i in range(4)]
    for thread in holders:
        thread.start()
    ready.wait(10)
    assert renewers() == before + 1  # four holds, one renewer
    wait_until(lambda: len(outlived) == 4, timeout=WAIT, what="all four holds to outlive their ttl")
    done.set()
    for thread in holders:
        thread.join(10)
    assert outlived == [True] * 4
    assert all(manager.current(f"sku:R{i}") is None for i in range(4))  # each released on exit


def test_a_hold_taken_while_the_renewer_naps_is_renewed_in_time(manager: LeaseManager) -> None:
    # The first hold starts the renewer; once it ends the renewer naps (a second at a time) and is woken
    # only for a lease due before that: this one's ttl is shorter than the nap.
    with manager.hold("sku:A", ttl=5, holder="A"):
        pass
    with manager.hold("sku:A", ttl=0.6, holder="B", renew_every=0.1) as lease:
        deadline = lease.acquired_at + 1.2  # twice the ttl, and past the renewer's nap
        wait_until(lambda: time.monotonic() > deadline, timeout=WAIT, what="twice the ttl to pass")
        info = manager.current("sku:A")
        assert info is not None and info.token == lease.token
        assert not lease.lost


def test_hold_marks_the_lease_lost_when_renewal_fails(manager: LeaseManager) -> None:
    with manager.hold("sku:A", ttl=5, holder="A", renew_every=0.02) as lease:
        manager.break_lease("sku:A", reason="test")
        wait_until(lambda: lease.lost, timeout=WAIT, what="the hold to mark its lease lost")
        with pytest.raises(LeaseLost):
            lease.raise_if_lost()
        # Another owner can take over while the lost holder is still inside its block.
        taker = manager.acquire("sku:A", ttl=5, holder="B")
    info = manager.current("sku:A")
    assert info is not None and info.token == taker.token  # the lost hold did not release B


BAD_SCOPES = ["", " sku", "sku ", "x" * 201, "sku\nA", "sku\x00", "sku\x7f", "\ud800", 17, None]


@pytest.mark.parametrize("scope", BAD_SCOPES, ids=repr)
def test_bad_scope_is_refused_and_writes_nothing(manager: LeaseManager, scope: object) -> None:
    with pytest.raises(InvalidLeaseRequest):
        manager.acquire(scope, ttl=5, holder="A")  # type: ignore[arg-type]
    with pytest.raises(InvalidLeaseRequest):
        manager.current(scope)  # type: ignore[arg-type]


ODD_SCOPES = ["sku:{A}", "sku:}{", "{", "sku:%7B", "ÜBER-ß-ナ", "x'; DROP TABLE fencing_leases;--", "x" * 200]


@pytest.mark.parametrize("scope", ODD_SCOPES, ids=repr)
def test_odd_but_valid_scopes_are_isolated(manager: LeaseManager, scope: str) -> None:
    lease = manager.acquire(scope, ttl=5, holder="A")
    assert manager.current("sku:A") is None
    info = manager.current(scope)
    assert info is not None and info.token == lease.token
    manager.release(lease)


@pytest.mark.parametrize("ttl", [0, -1, 0.001, 86401, float("nan"), float("inf"), True, "5", None])
def test_bad_ttl_is_refused(manager: LeaseManager, ttl: object) -> None:
    with pytest.raises(InvalidLeaseRequest):
        manager.acquire("sku:A", ttl=ttl, holder="A")  # type: ignore[arg-type]
    assert manager.current("sku:A") is None


@pytest.mark.parametrize("holder", ["", "h" * 201, "a\tb", 5])
def test_bad_holder_is_refused(manager: LeaseManager, holder: object) -> None:
    with pytest.raises(InvalidLeaseRequest):
        manager.acquire("sku:A", ttl=5, holder=holder)  # type: ignore[arg-type]
    assert manager.current("sku:A") is None


@pytest.mark.parametrize("token", [0, -1, 2**63, True, 1.5, "7", None], ids=repr)
def test_malformed_token_cannot_make_a_lease(token: object) -> None:
    with pytest.raises(InvalidLeaseRequest):
        Lease("sku:A", token, "a" * 32, "A", 5, 0.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("lease_id", ["", "A" * 32, "a" * 31, "g" * 32, None])
def test_malformed_lease_id_cannot_make_a_lease(lease_id: object) -> None:
    with pytest.raises(InvalidLeaseRequest):
        Lease("sku:A", 1, lease_id, "A", 5, 0.0)  # type: ignore[arg-type]


def test_not_a_lease_is_refused(manager: LeaseManager) -> None:
    with pytest.raises(InvalidLeaseRequest):
        manager.release("sku:A")  # type: ignore[arg-type]


def test_injected_clock_drives_local_validity(lease_stack: Stack) -> None:
    now = [1000.0]
    with lease_stack.manager(clock=lambda: now[0]) as manager:
        lease = manager.acquire("sku:A", ttl=5, holder="A")
        assert lease.acquired_at == 1000.0 and lease.time_left() == 5
        lease.ensure_held(margin=1)
        now[0] += 4.5
        with pytest.raises(LeaseLost):
            lease.ensure_held(margin=1)
        assert not lease.lost  # local caution is not loss: the coordinator still says it is held


async def test_async_manager_follows_the_same_rules(async_manager: AsyncLeaseManager) -> None:
    a = await async_manager.acquire("sku:A", ttl=5, holder="A")
    with pytest.raises(LeaseBusy):
        await async_manager.acquire("sku:A", ttl=5, holder="B")
    assert (await async_manager.renew(a)).token == a.token
    await async_manager.release(a)
    with pytest.raises(LeaseLost):
        await async_manager.release(a)
    b = await async_manager.acquire("sku:A", ttl=5, holder="B")
    assert b.token == a.token + 1
    info = await async_manager.current("sku:A")
    assert info is not None and info.holder == "B"
    events = await async_manager.history("sku:A")
    # Renewals change no owner and leave no event.
    assert [e.event for e in events] == ["acquired", "released", "acquired"]


async def test_async_hold_renews_and_releases(async_manager: AsyncLeaseManager) -> None:
    import asyncio

    # As the blocking hold's test: a ttl a loaded machine's SQLite write transactions get through.
    async with async_manager.hold("sku:A", ttl=0.6, holder="A", renew_every=0.1) as lease:
        deadline = lease.expires_at + 0.6
        while time.monotonic() < deadline:  # outlive the ttl while renewals keep the lease
            await asyncio.sleep(0.02)
        info = await async_manager.current("sku:A")
        assert info is not None and info.token == lease.token and not lease.lost
    assert await async_manager.current("sku:A") is None


async def test_async_hold_marks_lost_when_renewal_fails(async_manager: AsyncLeaseManager) -> None:
    import asyncio

    async with async_manager.hold("sku:A", ttl=5, holder="A", renew_every=0.02) as lease:
        await async_manager.break_lease("sku:A", reason="test")
        deadline = time.monotonic() + 5
        while not lease.lost and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert lease.lost


def test_a_renewal_is_asked_again_only_when_unanswered_and_time_is_left() -> None:
    from fencing import BackendUnavailable, SchemaMissing
    from fencing.manager import RETRY_UNANSWERED, retry_renewal

    def held(time_left: float) -> Lease:
        return Lease("sku:A", 3, new_lease_id(), "A", 60.0, time.monotonic() - 60.0 + time_left)

    unanswered = BackendUnavailable(backend="redis", operation="renew", detail="TimeoutError")
    assert retry_renewal(held(1.0), unanswered) == RETRY_UNANSWERED
    behind = SchemaMissing(operation="renew", problem="missing", detail="no table")
    assert retry_renewal(held(1.0), behind) == RETRY_UNANSWERED
    # Too little time for another try: given up, with the coordinator's failure as the reason.
    late = held(2 * RETRY_UNANSWERED)
    assert retry_renewal(late, unanswered) is None and late.lost_reason == f"renewal failed: {unanswered}"
    gone = LeaseLost(scope="sku:A", token=3, reason="expired")
    assert retry_renewal(held(1000.0), gone) is None
    odd = held(1000.0)
    assert retry_renewal(odd, RuntimeError("bug")) is None
    assert odd.lost_reason == "renewal failed: RuntimeError('bug')"


def test_history_retention(manager: LeaseManager) -> None:
    manager.release(manager.acquire("sku:A", ttl=5, holder="A"))
    assert manager.purge_history(older_than=3600) == 0  # recent events stay
    assert [e.event for e in manager.history("sku:A")] == ["acquired", "released"]
    with pytest.raises(InvalidLeaseRequest):
        manager.purge_history(older_than=1)


def test_released_lease_refuses_further_writes_locally(manager: LeaseManager) -> None:
    lease = manager.acquire("sku:A", ttl=5, holder="A")
    manager.release(lease)
    assert lease.lost and lease.lost_reason == "released by its holder"
    with pytest.raises(LeaseLost):
        lease.raise_if_lost()


def test_a_stale_rejection_on_one_scope_leaves_other_holds_intact(manager: LeaseManager) -> None:
    from fencing import StaleToken

    with pytest.raises(StaleToken), manager.hold("sku:A", ttl=30, holder="w") as a:  # noqa: SIM117
        with manager.hold("sku:B", ttl=30, holder="w") as b:
            raise StaleToken(scope="sku:A", presented=a.token, highest=a.token + 1)
    assert a.lost and b.lost_reason == "released by its holder"
    assert manager.current("sku:B") is None  # B was released, not left to block others until its ttl


def test_masked_urls_hide_every_password() -> None:
    from fencing.urls import mask_url

    assert mask_url("postgresql://app:s3cret@db/inv") == "postgresql://app:***@db/inv"
    assert "s3cret" not in mask_url("postgresql://app@db/inv?password=s3cret&sslmode=require")
    assert mask_url("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert mask_url("sqlite:////tmp/x.sqlite3") == "sqlite:////tmp/x.sqlite3"
    assert mask_url("redis://:my@secret@host/0") == "redis://:***@host/0"
    assert mask_url("amqp://app:a@b@c@mq:5672//") == "amqp://app:***@mq:5672//"
    assert mask_url("postgresql://a:s@c@db/inv?ssl=1") == "postgresql://a:***@db/inv?ssl=1"
    # Several hosts, and several URLs: the forms of Sentinel and Cluster leases and of kombu's Sentinel.
    assert (
        mask_url("redis+sentinel://:pw@s1:26379,s2:26379/inv/0")
        == "redis+sentinel://:***@s1:26379,s2:26379/inv/0"
    )
    assert mask_url("redis+cluster://u:p@w@h1:7000,h2:7001") == "redis+cluster://u:***@h1:7000,h2:7001"
    assert mask_url("sentinel://:pw@s1:26379/0;sentinel://:pw@s2:26380/0") == (
        "sentinel://:***@s1:26379/0;sentinel://:***@s2:26380/0"
    )
    assert (
        mask_url("redis+cluster://h1:7000,h2:7001?token=t0k") == "redis+cluster://h1:7000,h2:7001?token=***"
    )


def test_the_config_command_masks_a_password_holding_an_at_sign() -> None:
    from testing.support import run

    code, stdout, _ = run("--broker-url", "redis://:my@secret@mq:6379/0", "config", "--json", env={})
    assert code == 0 and "secret" not in stdout
    assert {"name": "RESERVATIONS_BROKER_URL", "value": "redis://:***@mq:6379/0", "source": "option"} in (
        json.loads(stdout)
    )


@pytest.mark.parametrize("url", ["redis://127.0.0.1:notaport/0", "not a url", "mysql://app@db/inv"])
def test_unusable_url_is_a_typed_error(url: str) -> None:
    with pytest.raises(InvalidLeaseRequest):
        LeaseManager.from_url(url)


def test_break_needs_a_reason(manager: LeaseManager) -> None:
    lease = manager.acquire("sku:A", ttl=5, holder="A")
    with pytest.raises(InvalidLeaseRequest):
        manager.break_lease("sku:A", reason=None)  # type: ignore[arg-type]
    info = manager.current("sku:A")
    assert info is not None and info.token == lease.token


# -- Redis footprint --------------------------------------------------------------------------------


def test_a_redis_scope_costs_a_bounded_few_hundred_bytes_however_often_it_is_leased(
    redis_prefix: str,
) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    with LeaseManager.from_url(REDIS_URL, prefix=redis_prefix) as manager:
        keys = scope_keys(redis_prefix, "sku:busy")

        def footprint() -> int:
            return sum(client.memory_usage(key, samples=0) or 0 for key in (keys.state, keys.log))

        for _ in range(110):
            manager.release(manager.acquire("sku:busy", ttl=5, holder="h:1:task"))
        early = footprint()
        for _ in range(190):
            manager.release(manager.acquire("sku:busy", ttl=5, holder="h:1:task"))
        # Bounded by the history cap, not by the number of leases (allocator rounding aside).
        assert footprint() <= early + 64
        assert footprint() < 1024
        assert client.llen(keys.log) == DEFAULT_HISTORY_CAP
        # The log expires with idleness; the counter, which keeps tokens monotonic, never does.
        assert 0 < client.pttl(keys.log) <= DEFAULT_HISTORY_RETENTION * 1000
        assert client.pttl(keys.state) == -1
        events = manager.history("sku:busy")
        acquired = [e.token for e in events if e.event == "acquired"]
        assert acquired == list(range(301 - DEFAULT_HISTORY_CAP, 301))
        assert events[-1].event == "released" and events[-1].token == 300
    client.close()


def test_purging_removes_event_streams_of_earlier_versions_only(redis_prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    legacy = [f"{redis_prefix}:{{sku:{i}}}:events" for i in range(3)]
    for key in legacy:
        client.xadd(key, {"event": "acquired", "token": "1"})
    with LeaseManager.from_url(REDIS_URL, prefix=redis_prefix) as manager:
        manager.release(manager.acquire("sku:kept", ttl=5, holder="h"))
        assert manager.purge_history() == 3
        assert client.exists(*legacy) == 0
        assert [e.event for e in manager.history("sku:kept")] == ["acquired", "released"]
        assert manager.purge_history() == 0
    client.close()


def test_an_acquirer_whose_holder_releases_between_its_statements_takes_the_lease(pg_url: str) -> None:
    """PostgreSQL runs each statement of a transaction on what committed before it began: the holder can
    release after the acquirer found its lease live and before the acquirer marks it contended. The mark
    would land on an ended epoch (its holder has already read "uncontended"), and a request queued
    behind it would wait for its watch; the acquirer must look again instead, and take the lease."""
    with LeaseManager.from_url(pg_url) as manager:
        manager.create_schema()
        holder = manager.acquire("sku:R", ttl=30, holder="H")
        executor = manager.executor
        assert isinstance(executor, SyncSqlExecutor)
        leases_updated = 0

        def handle(op: Op) -> object:
            nonlocal leases_updated
            assert isinstance(op, sa.Executable | Bound), op  # the SQL core's acquire sends statements
            rows = execute(conn, op)
            if isinstance(op, sa.Update):
                leases_updated += 1
                if leases_updated == 1:  # the acquire found the lease live: now its holder releases it
                    manager.release(holder)
            return rows

        with executor.engine.connect() as conn, conn.begin():
            got = run_sync(manager.core.acquire("sku:R", 30, "A", new_lease_id()), handle)
        assert isinstance(got, Lease), got
        assert got.token == holder.token + 1
        assert holder.contended is False


def test_an_executor_refuses_the_operations_of_the_other_backend(tmp_path: Path) -> None:
    """A plan is written for one backend's core: a Redis call reaching the SQL executor, or a statement
    reaching the Redis one, is a TypeError raised into the plan, not a silent wrong answer."""

    def sends(op: Op) -> Plan[str]:
        try:
            yield op
        except TypeError as exc:
            return str(exc)
        return "ran"

    sql = SyncSqlExecutor(make_engine(f"sqlite:///{tmp_path / 'plans.sqlite3'}"), time.sleep)
    assert sql.run(sends(ScriptCall("return 1", (), ()))) == "the SQL executor cannot run ScriptCall"
    assert sql.run(sends(Command(("PING",)))) == "the SQL executor cannot run Command"
    assert sql.run(sends(sa.select(sa.literal(1)))) == "ran"
    sql.close()
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    rd = SyncRedisExecutor(client, time.sleep)
    assert rd.run(sends(sa.select(sa.literal(1)))) == "the Redis executor cannot run Select"
    assert rd.run(sends(Command(("PING",)))) == "ran"
    rd.close()


async def test_a_redis_error_that_is_no_outage_is_raised_as_itself_and_not_asked_again(
    redis_prefix: str,
) -> None:
    """Only a lost connection or a "not now" answer is an outage that callers wait out or ask again
    (fencing.redis_executor). A script failing on a real Redis is redis-py's own error from both shells,
    and a renewal that met it is not asked again."""

    def runs(op: Op) -> Plan[object]:
        reply = yield op
        return reply

    # A Lua error at run time, as a bug in one of the lease scripts would raise it.
    broken = ScriptCall("return redis.call('INCR', KEYS[1])", (f"{redis_prefix}:text",), ())
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    client.set(f"{redis_prefix}:text", "not a number")
    sync_shell = SyncRedisExecutor(client, time.sleep)
    with pytest.raises(redis.ResponseError, match="not an integer") as failed:
        sync_shell.run(runs(broken))
    assert not outage(failed.value)
    assert retry_renewal(Lease("sku:A", 3, new_lease_id(), "A", 60.0, time.monotonic()), failed.value) is None
    sync_shell.close()
    async_client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)
    async_shell = AsyncRedisExecutor(async_client, asyncio.sleep)
    with pytest.raises(redis.ResponseError, match="not an integer"):
        await async_shell.run(runs(broken))
    await async_shell.close()
