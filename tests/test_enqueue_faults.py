"""Enqueues while the broker is unreachable: every async caller hears of it within one publish retry
round per batch, not one round per message of the batch ahead of it; sync and async callers alike hear
it as the client's own error (BrokerUnavailable, a TasksError) that is still kombu's OperationalError.
Every request was recorded before its publish failed, so the relay publishes it once the broker answers;
with the database down instead, nothing is recorded and nothing published."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import pytest
import redis
from celery import Celery
from kombu.exceptions import OperationalError

from fencing import BackendUnavailable
from reservations import Inventory, schema
from reservations.acceptance import accepted
from tasks import BrokerUnavailable, ReservationClient
from tasks.app import create_app
from tasks.settings import Settings
from testing.harness import free_port
from testing.proxy import DelayProxy
from testing.redis_servers import redis_server
from testing.support import queued_messages

CALLERS = 100
# One publish retry round is about 0.6 s and the callers span two batches; a round per message took 61 s.
ALL_HEARD_WITHIN = 5.0


def database(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'inventory.sqlite3'}"
    schema.upgrade(url)
    return url


def unreachable_broker(tmp_path: Path) -> Celery:
    return create_app(
        Settings.from_env(
            {
                "RESERVATIONS_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
                "RESERVATIONS_DATABASE_URL": database(tmp_path),
            }
        )
    )


def recorded(app: Celery, *keys: str) -> list[bool]:
    with Inventory.from_url(app.conf.reservations_settings.database_url) as inventory:
        return [inventory.executor.run(accepted(key)) is not None for key in keys]


async def test_concurrent_enqueuers_all_hear_of_an_unreachable_broker_at_once(tmp_path: Path) -> None:
    app = unreachable_broker(tmp_path)
    heard: list[OperationalError] = []

    async def enqueue(client: ReservationClient, i: int) -> None:
        try:
            await client.enqueue_reservation("SKU", 1, idempotency_key=f"down-{i}")
        except OperationalError as exc:
            heard.append(exc)

    try:
        async with ReservationClient(app) as client:
            with suppress(TimeoutError):  # those still waiting at the bound are counted out below
                async with asyncio.timeout(ALL_HEARD_WITHIN):
                    await asyncio.gather(*(enqueue(client, i) for i in range(CALLERS)))
    finally:
        app.close()
    assert len(heard) == CALLERS, f"{len(heard)} of {CALLERS} heard within {ALL_HEARD_WITHIN}s"
    assert len({id(exc) for exc in heard}) == CALLERS  # each raise adds to its own traceback
    assert {str(exc) for exc in heard} == {str(heard[0])}  # the broker's one answer, in every caller's words
    assert all(isinstance(exc, BrokerUnavailable) for exc in heard)
    assert all(recorded(app, *(f"down-{i}" for i in range(CALLERS))))


def test_a_blocking_enqueue_hears_of_an_unreachable_broker_as_the_clients_error(tmp_path: Path) -> None:
    app = unreachable_broker(tmp_path)
    try:
        with ReservationClient(app) as client, pytest.raises(BrokerUnavailable) as raised:
            client.enqueue_reservation_sync("SKU", 1, idempotency_key="down-sync")
    finally:
        app.close()
    assert isinstance(raised.value, OperationalError)
    assert isinstance(raised.value.__cause__, OperationalError)  # kombu's own, with its traceback
    assert recorded(app, "down-sync") == [True]


@pytest.mark.parametrize("shell", ["sync", "async"])
async def test_nothing_is_published_when_the_request_cannot_be_recorded(tmp_path: Path, shell: str) -> None:
    """The database is unusable (no schema): the enqueue fails with the database's error before anything
    reaches the broker, which is a broker that would refuse it anyway (nothing listens)."""
    app = create_app(
        Settings.from_env(
            {
                "RESERVATIONS_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0",
                "RESERVATIONS_DATABASE_URL": f"sqlite:///{tmp_path / 'unmigrated.sqlite3'}",
            }
        )
    )
    try:
        async with ReservationClient(app) as client:
            with pytest.raises(BackendUnavailable):
                if shell == "sync":
                    await asyncio.to_thread(client.enqueue_reservation_sync, "SKU", 1, idempotency_key="k")
                else:
                    await client.enqueue_reservation("SKU", 1, idempotency_key="k")
    finally:
        app.close()


async def test_a_batch_whose_pipeline_fails_is_published_again_one_by_one(tmp_path: Path) -> None:
    """A batch's pushes go in one pipeline on the publishing thread's pooled connection. When the link
    drops while the pipeline is on its way, every push of it is uncertain: each message is published
    again one by one, reconnecting, so every caller still gets its task id and every request is on the
    queue (a copy twice is harmless), none told the broker is down."""
    cuts: list[bytes] = []

    def watch() -> Callable[[bytes], None]:
        def seen(chunk: bytes) -> None:
            if not cuts and chunk.count(b"LPUSH") >= 2:  # a pipeline of pushes, the first one only
                cuts.append(chunk)
                link.cut()

        return seen

    with redis_server(tmp_path / "redis") as server:
        link = DelayProxy(("127.0.0.1", server.port), delay=0, fraction=0, observe=watch).start()
        app = create_app(
            Settings.from_env(
                {
                    "RESERVATIONS_BROKER_URL": f"redis://127.0.0.1:{link.port}/0",
                    "RESERVATIONS_DATABASE_URL": database(tmp_path),
                }
            )
        )
        broker = redis.Redis.from_url(server.url(0))
        client = ReservationClient(app)
        try:
            keys = [f"cut-{i}" for i in range(CALLERS)]
            handles = await asyncio.gather(
                *(client.enqueue_reservation("SKU", 1, idempotency_key=key) for key in keys)
            )
            assert cuts, "no pipeline of pushes went through the link"
            assert [handle.key for handle in handles] == keys
            queued = [message["kwargs"]["idempotency_key"] for message in queued_messages(broker)]
            assert set(queued) == set(keys)
        finally:
            await client.aclose()
            broker.close()
            link.close()
