"""Hot-SKU batching end to end through real Celery workers: requests queued behind a busy lease are served
in batches by its holder, a request whose holder died is served by its SKU's watch, a holder paused while
serving is fenced off, and every request ends with exactly one outcome that its asyncio handle sees. The
tests that lean on the broker (a watch's countdown, a burst of asynchronous publishes) run on RabbitMQ too.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import redis

from reservations import scope_of
from reservations.request_outcomes import RequestResult, request_id
from tasks import ReservationClient
from testing.harness import process_state, wait_until
from testing.redis_servers import redis_server
from testing.workers import (
    BROKERS,
    FAULT_TIMEOUT,
    KEEP_RESULTS,
    Stack,
    client_result,
    identity,
    logged,
    rabbitmq_vhost,
    stack,
)

pytestmark = pytest.mark.slow

TTL = 1.0
OUTCOME_TIMEOUT = 30.0


def hot_stack(tmp_path_factory: pytest.TempPathFactory, broker: str) -> Iterator[Stack]:
    """Two workers, SQL leases with a short ttl, waiting requests checking on themselves every 0.2 s+;
    on a private redis-server, which is also the broker unless ``broker`` is RabbitMQ (a vhost of its own)."""
    with ExitStack() as stacked:
        server = stacked.enter_context(redis_server(tmp_path_factory.mktemp("redis")))
        url = stacked.enter_context(rabbitmq_vhost("hot")) if broker == "rabbitmq" else None
        yield stacked.enter_context(
            stack(
                "hot",
                tmp_path_factory.mktemp(f"hot_{broker}_cluster"),
                server,
                0,
                broker=url,
                RESERVATIONS_LEASE_TTL=str(TTL),
                RESERVATIONS_HANDOFF_CHECK="0.2",
                # The server of a batch stores each served request's Celery result: under test here.
                **KEEP_RESULTS,
            )
        )


@pytest.fixture(scope="module")
def hot_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from hot_stack(tmp_path_factory, "redis")


@pytest.fixture(scope="module")
def hot_rabbitmq(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from hot_stack(tmp_path_factory, "rabbitmq")


@pytest.fixture
def hot(request: pytest.FixtureRequest) -> Stack:
    """The hot-SKU cluster on the broker a test is parametrized with (indirectly), Redis by default."""
    running: Stack = request.getfixturevalue(f"hot_{getattr(request, 'param', 'redis')}")
    return running


def queued_behind(stack: Stack, sku: str, keys: list[str], quantity: int = 1) -> None:
    """Enqueue ``keys`` while the test holds the SKU's lease; return once all of them wait for the holder."""
    for key in keys:
        stack.client.enqueue_reservation_sync(sku, quantity, idempotency_key=key)
    try:
        wait_until(
            lambda: stack.inventory.pending_count(sku) == len(keys),
            timeout=OUTCOME_TIMEOUT,
            what=f"{len(keys)} requests to queue for the holder of {sku}",
        )
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{stack.cluster.tails()}") from None


def outcome_of(stack: Stack, key: str) -> RequestResult:
    def found() -> RequestResult | None:
        return stack.inventory.request_outcome(key)

    return wait_until(found, timeout=OUTCOME_TIMEOUT, what=f"an outcome for {key}")


def exactly_once(stack: Stack, sku: str, outcomes: dict[str, RequestResult]) -> None:
    """Each reserved key holds one reservation from one write; the SKU's books and the queue agree."""
    inv = stack.inventory
    for key, outcome in outcomes.items():
        assert inv.request_outcome(key) == outcome
        assert outcome.task_id == request_id(key)
        expected = 1 if outcome.status == "reserved" else 0
        assert len(stack.reservations_of(sku, key)) == expected, key
        assert stack.writes_of(sku, key) == ["reserve"] * expected, key
        assert Counter(a.result for a in inv.attempts(key))["applied"] == expected, inv.attempts(key)
    reserved = sum(1 for o in outcomes.values() if o.status == "reserved")
    assert inv.stock(sku).reserved == sum(
        o.detail["quantity"] for o in outcomes.values() if o.status == "reserved"
    )
    assert reserved > 0
    assert inv.pending_count(sku) == 0
    assert inv.invariant_violations() == []


@pytest.mark.parametrize("hot", BROKERS, indirect=True)
def test_requests_behind_a_dead_holder_are_served_by_their_own_checks(hot: Stack) -> None:
    sku, inv = "DEAD", hot.inventory
    inv.add_sku(sku, on_hand=5)
    keys = [f"dead-{i}" for i in range(8)]
    # The test is the holder; everything queues behind it, then its lease ends without it ever serving
    # (as when a dead holder's lease runs out) and without any new request of the SKU arriving.
    dead = hot.leases.acquire(scope_of(sku), ttl=30, holder="dead-holder")
    queued_behind(hot, sku, keys)
    hot.leases.break_lease(scope_of(sku), reason="the holder died")

    outcomes = {key: outcome_of(hot, key) for key in keys}
    assert Counter(o.status for o in outcomes.values()) == {"reserved": 5, "insufficient_stock": 3}
    # Nobody else came along: the watch the first waiting request scheduled served them, in a batch.
    assert len({o.detail["served_by"] for o in outcomes.values()}) == 1
    assert all(o.detail["token"] > dead.token for o in outcomes.values() if o.status == "reserved")
    exactly_once(hot, sku, outcomes)
    # Each request's own Celery result was written by the server of its batch.
    for key, outcome in outcomes.items():
        result = client_result(hot, request_id(key))
        assert (result["key"], result["status"]) == (key, outcome.status)


@pytest.mark.parametrize("hot", BROKERS, indirect=True)
def test_a_hot_burst_awaited_from_asyncio_gets_one_outcome_each(hot: Stack) -> None:
    sku, inv = "FLASH", hot.inventory
    inv.add_sku(sku, on_hand=15)
    keys = [f"flash-{i}" for i in range(40)]

    async def burst() -> list[RequestResult]:
        client = ReservationClient(hot.cluster.app())
        try:
            handles = await asyncio.gather(
                *(client.enqueue_reservation(sku, 1, idempotency_key=key) for key in keys)
            )
            return list(await asyncio.gather(*(h.result(timeout=OUTCOME_TIMEOUT) for h in handles)))
        finally:
            client.close()
            client.app.close()

    outcomes = dict(zip(keys, asyncio.run(burst()), strict=True))
    assert Counter(o.status for o in outcomes.values()) == {"reserved": 15, "insufficient_stock": 25}
    exactly_once(hot, sku, outcomes)
    batched = sum(1 for o in outcomes.values() if o.detail.get("served_by") not in (None, o.task_id))
    print(f"\n{batched} of {len(keys)} requests served in a batch by another request's task")


def test_a_holder_paused_while_serving_is_fenced_off(hot: Stack) -> None:
    sku, inv, leases = "PAUSE", hot.inventory, hot.leases
    inv.add_sku(sku, on_hand=20)
    keys = [f"pause-{i}" for i in range(6)]
    mine = leases.acquire(scope_of(sku), ttl=30, holder="test")
    queued_behind(hot, sku, keys, quantity=2)
    # The first task to take the lease after us stops itself right before serving its first batch.
    hot.cluster.arm("before_write", settle=False)  # its requests wait on our lease
    leases.release(mine)
    stopped = None
    try:
        try:
            _worker, stopped = wait_until(
                hot.cluster.worker_with_stopped_child, timeout=FAULT_TIMEOUT, what="a server to stop itself"
            )
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{hot.cluster.tails()}") from None
        events = leases.history(scope_of(sku))
        (paused,) = [
            e for e in events if e.event == "acquired" and (e.holder or "").startswith(identity(stopped))
        ]
        wait_until(
            lambda: leases.current(scope_of(sku)) is None, timeout=FAULT_TIMEOUT, what="its lease to expire"
        )
        # A newer holder (the test) serves the queue, and more requests queue up behind the paused one.
        with leases.hold(scope_of(sku), ttl=30, holder="newer") as newer:
            served = inv.serve_pending(newer, sku, limit=100)
            later = [f"pause-late-{i}" for i in range(3)]
            for key in later:
                inv.hand_off(sku, 1, key=key, task_id=request_id(key))
        assert sorted(r.key for r in served) == keys
        assert process_state(stopped) == "T", "the server must still be stopped"
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
    # Resumed, the paused server's batch is refused whole (at the row, or locally once its renewal finds
    # the lease gone) and it stops serving under that lease; the late requests are served afterwards under
    # a fresh one (by the same watch, looking again).
    outcomes = {key: outcome_of(hot, key) for key in keys + later}
    assert {o.status for o in outcomes.values()} == {"reserved"}
    assert all(o.detail["token"] > paused.token for o in outcomes.values())
    rejected = [h for h in inv.history(sku) if h.kind == "rejected"]
    assert [(h.token, h.idempotency_key) for h in rejected] in ([], [(paused.token, None)])
    assert not [r for r in inv.reservations(sku) if r.token == paused.token]
    for key in later:  # served by a task: their Celery results were written too
        assert client_result(hot, request_id(key))["status"] == "reserved"
    exactly_once(hot, sku, outcomes)
    assert inv.stock(sku).reserved == 2 * len(keys) + len(later)


@pytest.mark.parametrize("lease_backend", ["sql", "redis"])
def test_a_holder_serves_what_queued_behind_it_as_soon_as_it_releases(
    tmp_path: Path, lease_backend: str
) -> None:
    """Requests that found the lease busy are served by its holder right after its release, not by
    their SKU's watch: the release reports that acquirers were turned away. The watch is set far beyond
    the test's patience, so only the holder's look can serve them."""
    with redis_server(tmp_path / "redis") as server, ExitStack() as stacked:
        leases_at = {"RESERVATIONS_LEASE_URL": server.url(2)} if lease_backend == "redis" else {}
        running = stacked.enter_context(
            stack(
                "handoff",
                tmp_path / "cluster",
                server,
                0,
                failpoint_spec="before_write=stop,once",
                RESERVATIONS_LEASE_TTL="30",
                RESERVATIONS_HANDOFF_CHECK="600",
                **leases_at,
            )
        )
        sku, inv = "BEHIND", running.inventory
        inv.add_sku(sku, on_hand=10)
        running.cluster.arm("before_write")
        running.client.enqueue_reservation_sync(sku, 1, idempotency_key="holder")
        stopped = None
        try:
            try:
                _worker, stopped = wait_until(
                    running.cluster.worker_with_stopped_child,
                    timeout=FAULT_TIMEOUT,
                    what="the holder to stop itself",
                )
            except TimeoutError as exc:
                raise AssertionError(f"{exc}\n{running.cluster.tails()}") from None
            keys = [f"behind-{i}" for i in range(3)]
            queued_behind(running, sku, keys)
        finally:
            if stopped is not None:
                os.kill(stopped, signal.SIGCONT)
        outcomes = {key: outcome_of(running, key) for key in ["holder", *keys]}
        assert {o.status for o in outcomes.values()} == {"reserved"}
        holder_token = outcomes["holder"].detail["token"]
        # Served by the holder's task under the next token, right after its release, not by the watch.
        assert all(outcomes[key].detail["served_by"] == request_id("holder") for key in keys)
        assert all(outcomes[key].detail["token"] == holder_token + 1 for key in keys)
        exactly_once(running, sku, outcomes)
        # At the default retention neither the holder nor those it served store a Celery result. Its
        # task logs its success once the results would have been stored.
        wait_until(
            lambda: logged(running, request_id("holder"), "succeeded"), timeout=FAULT_TIMEOUT, what="its end"
        )
        with redis.Redis.from_url(running.cluster.parsed.result_backend) as results:
            assert not results.exists(*(f"celery-task-meta-{request_id(key)}" for key in outcomes))


def test_the_sweep_serves_requests_nobody_else_would(hot: Stack) -> None:
    """Requests queued with no task of their own to check on them (as when their checks sit in a frozen
    worker) are served by the beat sweep once they waited longer than a lease ttl."""
    sku, inv = "SWEPT", hot.inventory
    inv.add_sku(sku, on_hand=3)
    keys = [f"swept-{i}" for i in range(4)]
    for key in keys:
        inv.hand_off(sku, 1, key=key, task_id=request_id(key))

    def swept() -> bool:
        if not inv.skus_waiting(older_than=0):
            return True
        hot.client.app.send_task("reservations.serve_waiting").get(timeout=OUTCOME_TIMEOUT)
        return not inv.skus_waiting(older_than=0)

    wait_until(swept, timeout=OUTCOME_TIMEOUT, what="the sweep to serve the queue", interval=TTL / 2)
    outcomes = {key: outcome_of(hot, key) for key in keys}
    assert Counter(o.status for o in outcomes.values()) == {"reserved": 3, "insufficient_stock": 1}
    exactly_once(hot, sku, outcomes)


def test_batching_off_still_serves_a_hot_sku_by_retrying(tmp_path: Path) -> None:
    with (
        redis_server(tmp_path / "redis") as server,
        stack("nobatch", tmp_path / "cluster", server, 0, RESERVATIONS_BATCHING="0") as running,
    ):
        sku = "NOBATCH"
        running.inventory.add_sku(sku, on_hand=6)
        keys = [f"nobatch-{i}" for i in range(10)]
        handles = [running.client.enqueue_reservation_sync(sku, 1, idempotency_key=k) for k in keys]
        outcomes = dict(zip(keys, running.results(handles), strict=True))
        assert Counter(o.status for o in outcomes.values()) == {"reserved": 6, "insufficient_stock": 4}
        assert all("served_by" not in o.detail for o in outcomes.values())
        exactly_once(running, sku, outcomes)
