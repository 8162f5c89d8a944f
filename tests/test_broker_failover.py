"""The broker and result backend on Redis Sentinel, and a failover that loses queued requests.

A primary, a replica and three sentinels (``redis-server <conf> --sentinel``) serve Celery's Sentinel
transport and result backend; real workers and a client reach them by ``sentinel://`` URLs. Requests
flow end to end through them; then the primary is killed with requests queued that its replica never
received (asynchronous replication), the sentinels promote the replica, and the workers' relay publishes
each recorded request the broker no longer carries again after ``RESERVATIONS_REPUBLISH_AFTER``: every
request ends with exactly one outcome, each applied once. The relay's decision is checked without
services in tests/test_relay.py.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from reservations import Inventory
from tasks import ReservationClient, Settings, create_app
from tasks.producer import Producer
from testing.harness import wait_until
from testing.redis_topologies import SentinelTopology, sentinel_topology
from testing.workers import cluster, pg_schema

SERVICE = "broker"
# How long a sentinel waits for an unanswered primary before it calls it down: short, so the failover
# takes about two seconds here (a production deployment keeps Sentinel's own default or close to it).
DOWN_AFTER_MS = 500
FAILOVER_TIMEOUT_MS = 3000


@contextmanager
def broker_topology(folder: Path) -> Iterator[SentinelTopology]:
    """A primary, a replica replicating through a relay, and three sentinels watching the primary as
    service ``SERVICE``, without a password. Without persistence: a killed node's data is gone."""
    with sentinel_topology(
        folder,
        service=SERVICE,
        password=None,
        relayed=True,
        down_after_ms=DOWN_AFTER_MS,
        failover_timeout_ms=FAILOVER_TIMEOUT_MS,
    ) as topology:
        yield topology


def test_workers_and_producers_get_the_service_name_with_the_visibility_timeout() -> None:
    settings = Settings(
        broker_url="sentinel://s1:26379/0;sentinel://s2:26380/0",
        result_backend="sentinel://s1:26379/1;sentinel://s2:26380/1",
        sentinel_master=SERVICE,
        visibility_timeout=600.0,
    )
    app = create_app(settings)
    options = {"visibility_timeout": 600.0, "master_name": SERVICE}
    assert app.conf.broker_transport_options == options
    assert options.items() <= app.conf.result_backend_transport_options.items()
    with Producer.configured(settings) as producer:
        assert producer.app.conf.broker_transport_options == options
    app.close()


# -- through Sentinel, end to end ------------------------------------------------------------------------

SKU = "SENTINEL-1"
OUTCOME_TIMEOUT = 30.0
GATE_TIMEOUT = 20.0  # a wait of the test's own, shorter than the handles' so that it is what fails
# Short here; the default is 10 s (RESERVATIONS_REPUBLISH_AFTER, docs/architecture.md).
REPUBLISH_AFTER = 2.0
RELAY_EVERY = 0.5


def sentinel_env(topology: SentinelTopology, database_url: str) -> dict[str, str]:
    """The workers' settings: broker and results through the sentinels, leases on the database."""
    return {
        "RESERVATIONS_BROKER_URL": topology.broker_url(0),
        "RESERVATIONS_RESULT_BACKEND": topology.broker_url(1),
        "RESERVATIONS_SENTINEL_MASTER": SERVICE,
        "RESERVATIONS_DATABASE_URL": database_url,
    }


def writes_by_key(inventory: Inventory) -> Counter[str]:
    """The SKU's accepted writes per request key (adding the SKU writes under none)."""
    history = inventory.history(SKU)
    return Counter(h.idempotency_key for h in history if h.kind == "write" and h.idempotency_key)


@pytest.mark.slow
def test_requests_flow_through_the_sentinel_broker_and_result_backend(tmp_path: Path) -> None:
    with (
        broker_topology(tmp_path / "redis") as topology,
        pg_schema() as database,
        Inventory.from_url(database) as inventory,
    ):
        inventory.add_sku(SKU, on_hand=10)
        # Requests keep their Celery result: the Sentinel result backend is under test.
        env = {**sentinel_env(topology, database), "RESERVATIONS_RESULT_EXPIRES": "600"}
        with cluster(tmp_path / "workers", env, prefix="s") as running:
            for worker in running.workers:  # the banner names the transport a worker consumes from
                assert "transport:   sentinel://" in worker.log(), worker.tail()
            client = ReservationClient(create_app(running.parsed))
            try:
                handles = [
                    client.enqueue_reservation_sync(SKU, 1, idempotency_key=f"flow-{n}") for n in range(4)
                ]
                # The command line's producer reaches the same broker with the same transport options.
                with Producer.configured(running.parsed) as producer:
                    producer.send("reserve", "flow-cli", {"sku": SKU, "quantity": 1, "hold_for": None})
                outcomes = [h.result_sync(timeout=OUTCOME_TIMEOUT) for h in handles]
                outcomes.append(client.wait_sync("flow-cli", timeout=OUTCOME_TIMEOUT))
                # Celery's own result, through the Sentinel result backend.
                stored = client.app.AsyncResult(handles[0].task_id).get(timeout=OUTCOME_TIMEOUT)
            finally:
                client.close()
                client.app.close()
        assert [o.status for o in outcomes] == ["reserved"] * 5, running.tails()
        assert stored["status"] == "reserved"
        assert writes_by_key(inventory) == {f"flow-{n}": 1 for n in range(4)} | {"flow-cli": 1}
        with topology.data[0].client(db=1) as results:
            assert results.exists(f"celery-task-meta-{handles[0].task_id}")


async def forget(waits: list[asyncio.Future[Any]]) -> None:
    """The waits a failed test leaves behind, cancelled and their errors taken (asyncio would print them)."""
    for wait in waits:
        wait.cancel()
    await asyncio.gather(*waits, return_exceptions=True)


@pytest.mark.slow
async def test_requests_lost_in_a_failover_are_published_again_and_each_ends_once(tmp_path: Path) -> None:
    """The replica misses the last requests published (its link holds them when the primary is killed),
    the sentinels promote it, and the workers' relay publishes again every recorded request without an
    outcome that the promoted broker does not carry: the lost ones are back, the kept ones are not copied,
    and each is applied once. Nobody awaits the requests while this happens."""
    async with AsyncExitStack() as stack:
        topology = stack.enter_context(broker_topology(tmp_path / "redis"))
        database = stack.enter_context(pg_schema())
        inventory = stack.enter_context(Inventory.from_url(database))
        inventory.add_sku(SKU, on_hand=100)
        env = {
            **sentinel_env(topology, database),
            "RESERVATIONS_REPUBLISH_AFTER": f"{REPUBLISH_AFTER:g}",
            "RESERVATIONS_RELAY_EVERY": f"{RELAY_EVERY:g}",
        }
        settings = Settings.from_env(env)
        client = ReservationClient(create_app(settings))
        stack.callback(client.app.close)
        stack.push_async_callback(client.aclose)
        primary = stack.enter_context(topology.data[0].client())
        replica = stack.enter_context(topology.data[1].client())

        # Replicated before the primary is lost: these survive the failover.
        kept = [await client.enqueue_reservation(SKU, 1, idempotency_key=f"kept-{n}") for n in range(3)]
        await asyncio.to_thread(
            wait_until, lambda: replica.llen("celery") == len(kept), timeout=10, what="the replica's copy"
        )
        assert topology.relay is not None
        topology.relay.hold()
        lost = [await client.enqueue_reservation(SKU, 1, idempotency_key=f"lost-{n}") for n in range(5)]
        assert (primary.llen("celery"), replica.llen("celery")) == (len(kept) + len(lost), len(kept))

        topology.data[0].kill()
        topology.relay.sever()
        await asyncio.to_thread(
            wait_until,
            lambda: topology.named_primary() == topology.data[1].port,
            timeout=30,
            what="the sentinels to promote the replica",
        )
        assert replica.llen("celery") == len(kept)  # the lost ones are gone from the broker

        running = await asyncio.to_thread(stack.enter_context, cluster(tmp_path / "workers", env, prefix="f"))
        waits = [asyncio.ensure_future(h.result(timeout=OUTCOME_TIMEOUT)) for h in [*kept, *lost]]
        stack.push_async_callback(forget, waits)
        outcomes = await asyncio.gather(*waits)

        assert [o.status for o in outcomes] == ["reserved"] * len(waits), running.tails()
        # One write per key: the second copy of a kept request found its outcome stored.
        assert writes_by_key(inventory) == {h.key: 1 for h in [*kept, *lost]}
        level = inventory.stock(SKU)
        assert (level.on_hand, level.available) == (100, 100 - len(kept) - len(lost))
        # A kept request was still queued: the relay sent no copy of it; a lost one was published again.
        logs = "".join(worker.log() for worker in running.workers)
        received = {
            h.key: logs.count(f"Task reservations.reserve[{h.task_id}] received") for h in [*kept, *lost]
        }
        assert all(received[h.key] == 1 for h in kept) and all(received[h.key] >= 1 for h in lost), received
        assert "relay: published lost-0 again" in logs, running.tails()
