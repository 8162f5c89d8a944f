"""The shared outcome watcher on SQLite and PostgreSQL: many awaiting handles are resolved by a few reads
of all their keys at once, timeouts and cancellation leave nothing behind, a closed watcher fails its
waiters, an unreachable database (or broker) reaches each waiter (or enqueuer) as an error rather than a
silent timeout, and a closed client neither publishes nor waits. And the front door's admissions, which the
same client's publishing thread admits together: one record and one message per key.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import redis
from kombu.exceptions import OperationalError

from fencing import BackendUnavailable
from reservations import AsyncInventory, Inventory
from reservations.request_outcomes import RequestResult
from tasks import ClientClosed, ReservationClient, Settings, TasksError, create_app
from tasks.errors import OutcomeTimeout, WatcherClosed
from tasks.outbox import _settle_few
from tasks.outcomes import SETTLED_PER_TURN, OutcomeWatcher
from tasks.producer import request_of
from testing.redis_servers import redis_server


class CountedReads:
    """The real read of the outcome rows, counting how often it is asked and for how many keys."""

    def __init__(self, inventory: AsyncInventory) -> None:
        self.inventory = inventory
        self.reads: list[int] = []

    async def __call__(self, keys: Sequence[str]) -> dict[str, RequestResult]:
        self.reads.append(len(keys))
        return await self.inventory.request_outcomes(keys)


@pytest.fixture
async def reads(inventory_url: str) -> AsyncIterator[CountedReads]:
    inventory = AsyncInventory.from_url(inventory_url)
    yield CountedReads(inventory)
    await inventory.close()


async def test_many_waiters_are_resolved_by_one_read_of_all_their_keys(
    inventory: Inventory, reads: CountedReads
) -> None:
    keys = [f"many-{i}" for i in range(300)]
    for key in keys:
        inventory.record_outcome(key, "reserve", "reserved", {"n": key})
    watcher = OutcomeWatcher(reads)
    # Three hundred handles (two of them on one key) arrive together: one read answers them all.
    results = await asyncio.gather(*(watcher.wait(key, timeout=30) for key in [*keys, keys[0]]))
    assert [r.key for r in results] == [*keys, keys[0]]
    assert all(r.detail == {"n": r.key} for r in results)
    assert reads.reads == [len(keys)]
    assert watcher.waiting == 0
    await watcher.aclose()


async def test_outcomes_written_while_handles_wait_resolve_them(
    inventory: Inventory, reads: CountedReads
) -> None:
    watcher = OutcomeWatcher(reads)
    keys = [f"later-{i}" for i in range(20)]
    waits = [asyncio.ensure_future(watcher.wait(key, timeout=30)) for key in keys]
    while watcher.waiting < len(keys):
        await asyncio.sleep(0.001)

    def record_all() -> None:
        for key in keys:
            inventory.record_outcome(key, "reserve", "reserved", {})

    await asyncio.to_thread(record_all)
    assert [r.key for r in await asyncio.gather(*waits)] == keys
    # Each look read every key still waiting: never one query per handle.
    assert reads.reads[0] == len(keys)
    assert reads.reads == sorted(reads.reads, reverse=True)
    await watcher.aclose()


async def test_a_timeout_or_a_cancelled_waiter_leaves_nothing_behind(
    inventory: Inventory, reads: CountedReads
) -> None:
    watcher = OutcomeWatcher(reads)
    with pytest.raises(OutcomeTimeout) as timed_out:
        await watcher.wait("never", timeout=0.05)
    assert timed_out.value.key == "never"
    assert watcher.waiting == 0

    cancelled = asyncio.ensure_future(watcher.wait("cancelled", timeout=30))
    while watcher.waiting == 0:
        await asyncio.sleep(0.001)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert watcher.waiting == 0
    # Nobody waits: the watcher stops reading.
    settled = len(reads.reads)
    await asyncio.sleep(3 * OutcomeWatcher.SLOWEST)
    assert len(reads.reads) <= settled + 1

    # And a later waiter starts it again.
    inventory.record_outcome("later", "reserve", "reserved", {})
    assert (await watcher.wait("later", timeout=5)).status == "reserved"
    await watcher.aclose()


async def test_closing_the_watcher_fails_its_waiters(reads: CountedReads) -> None:
    watcher = OutcomeWatcher(reads)
    pending = asyncio.ensure_future(watcher.wait("open", timeout=30))
    while watcher.waiting == 0:
        await asyncio.sleep(0.001)
    await watcher.aclose()
    with pytest.raises(WatcherClosed):
        await pending
    with pytest.raises(WatcherClosed):
        await watcher.wait("after", timeout=1)


async def test_an_unreachable_database_reaches_every_waiter_as_an_error() -> None:
    # A port nothing listens on (the discard port on loopback): every read fails to connect.
    inventory = AsyncInventory.from_url("postgresql+psycopg://postgres@127.0.0.1:9/test?connect_timeout=2")
    watcher = OutcomeWatcher(inventory.request_outcomes)
    try:
        results = await asyncio.gather(
            *(watcher.wait(f"down-{i}", timeout=20) for i in range(5)), return_exceptions=True
        )
        assert all(isinstance(r, BackendUnavailable) for r in results), results
        assert len({id(r) for r in results}) == len(results)  # one instance each, not one shared
        assert watcher.waiting == 0
    finally:
        await watcher.aclose()
        await inventory.close()


async def test_a_closed_client_refuses_to_enqueue_or_wait(inventory_url: str) -> None:
    app = create_app(Settings.from_env({"RESERVATIONS_DATABASE_URL": inventory_url}))
    try:
        async with ReservationClient(app) as client:
            with pytest.raises(OutcomeTimeout):  # its watcher and pool exist, and close with it
                await client.wait("nobody", timeout=0.05)
        with pytest.raises(ClientClosed):
            await client.enqueue_reservation("SKU", 1, idempotency_key="late")
        with pytest.raises(ClientClosed):
            await client.wait("nobody", timeout=1)
        with pytest.raises(ClientClosed):  # the blocking shells alike
            client.enqueue_reservation_sync("SKU", 1, idempotency_key="late")
        with pytest.raises(ClientClosed):
            client.wait_sync("nobody", timeout=1)
    finally:
        app.close()


async def test_an_unreachable_broker_reaches_every_enqueuer_as_an_error(inventory_url: str) -> None:
    app = create_app(
        Settings.from_env(
            {"RESERVATIONS_BROKER_URL": "redis://127.0.0.1:9/0", "RESERVATIONS_DATABASE_URL": inventory_url}
        )
    )
    try:
        async with ReservationClient(app) as client:
            results = await asyncio.gather(
                *(client.enqueue_reservation("SKU", 1, idempotency_key=f"down-{i}") for i in range(2)),
                return_exceptions=True,
            )
        # kombu's error, as the client's own: caught as either.
        assert all(isinstance(r, OperationalError) and isinstance(r, TasksError) for r in results), results
    finally:
        app.close()


async def test_looks_at_every_key_leave_the_loop_time_while_new_keys_are_still_heard_at_once() -> None:
    """With many keys waiting a look at all of them costs the loop milliseconds; keys arriving every few
    milliseconds must not make such looks back to back. New keys are looked at on their own meanwhile."""
    decided: dict[str, RequestResult] = {}
    full_looks: list[float] = []
    loop = asyncio.get_running_loop()
    waiting_keys = 200

    async def read(keys: Sequence[str]) -> dict[str, RequestResult]:
        if len(keys) >= waiting_keys:
            full_looks.append(loop.time())
            time.sleep(0.02)  # the loop is busy reading, as with a thousand parameters to bind and parse
        return {key: decided[key] for key in keys if key in decided}

    watcher = OutcomeWatcher(read)
    never = [asyncio.ensure_future(watcher.wait(f"open-{i}", timeout=30)) for i in range(waiting_keys)]
    heard: list[float] = []
    start = loop.time()
    while loop.time() - start < 0.6:  # a new request every 3 ms, its outcome already there
        key = f"new-{len(heard)}"
        decided[key] = RequestResult(key, "reserve", "reserved", {}, None, None, 0, 0.0)
        began = loop.time()
        await watcher.wait(key, timeout=5)
        heard.append(loop.time() - began)
        await asyncio.sleep(0.003)
    spaced = [b - a for a, b in itertools.pairwise(full_looks)]
    # Each look at every key (20 ms) is followed by more than twice as long without one (SPACING: three).
    assert spaced and min(spaced) >= 0.05, spaced
    assert sorted(heard)[len(heard) // 2] < 0.05, heard  # new keys: within a few looks of their own
    for waiter in never:
        waiter.cancel()
    await asyncio.gather(*never, return_exceptions=True)
    await watcher.aclose()


async def test_requests_admitted_together_are_recorded_and_published_once_per_key(
    inventory_url: str, tmp_path: Path
) -> None:
    """The front door admits each request through the client's publishing thread, which admits together
    what arrived while it was busy (on PostgreSQL in one statement). Copies of one request admitted at once
    are recorded and published once, and only one copy is told it was first; a different request sent at
    the same time under one of the keys hears the record that took the key."""
    keys = [f"together-{i}" for i in range(10)]
    sent = [request_of("reserve", k, {"sku": "T", "quantity": 1}) for k in keys * 5]
    sent.append(request_of("reserve", keys[0], {"sku": "T", "quantity": 2}))
    random.Random(3).shuffle(sent)
    with redis_server(tmp_path / "broker") as server:
        settings = {"RESERVATIONS_BROKER_URL": server.url(0), "RESERVATIONS_DATABASE_URL": inventory_url}
        app = create_app(Settings.from_env(settings))
        try:
            async with ReservationClient(app) as client:
                admitted = await asyncio.gather(*(client.admit(request) for request in sent))
            with redis.Redis.from_url(server.url(0)) as broker:
                queued = sum(int(broker.llen(k)) for k in broker.scan_iter("celery*"))
        finally:
            app.close()
    firsts = [request.key for request, one in zip(sent, admitted, strict=True) if one.admission.first]
    assert sorted(firsts) == sorted(keys)
    assert all((one.task_id is not None) == one.admission.first for one in admitted)
    assert all(one.unpublished is None and one.admission.outcome is None for one in admitted)
    taken = {one.admission.accepted.key: one.admission.accepted for one in admitted if one.admission.first}
    assert all(
        one.admission.accepted == taken[request.key] for request, one in zip(sent, admitted, strict=True)
    )
    assert queued == len(keys)


async def test_a_batch_s_senders_are_woken_a_few_per_turn_of_their_loop() -> None:
    """The publishing thread answers a whole batch at once; its senders are settled a few per turn of
    their event loop, so that a request the loop serves meanwhile (a health check) waits for a few
    handlers, not for the batch."""
    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in range(2 * SETTLED_PER_TURN + 3)]
    _settle_few(loop, [(future, n, None) for n, future in enumerate(futures)])
    done = []
    for _ in range(4):
        done.append(sum(future.done() for future in futures))
        await asyncio.sleep(0)
    assert done == [SETTLED_PER_TURN, 2 * SETTLED_PER_TURN, len(futures), len(futures)]
    assert [future.result() for future in futures] == list(range(len(futures)))
