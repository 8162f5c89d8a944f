"""Enqueues while the broker is unreachable: every async caller hears of it within one publish retry
round per batch, not one round per message of the batch ahead of it; sync and async callers alike hear
it as the client's own error (BrokerUnavailable, a TasksError) that is still kombu's OperationalError.
Every request was recorded before its publish failed, so the relay publishes it once the broker answers;
with the database down instead, nothing is recorded and nothing published."""

from __future__ import annotations

import asyncio
from contextlib import suppress
from pathlib import Path

import pytest
from celery import Celery
from kombu.exceptions import OperationalError

from fencing import BackendUnavailable
from reservations import Inventory, schema
from reservations.acceptance import accepted
from tasks import BrokerUnavailable, ReservationClient
from tasks.app import create_app
from tasks.settings import Settings
from testing.harness import free_port

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
