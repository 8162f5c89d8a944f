"""Enqueue requests and await their outcomes, from asyncio services or from plain scripts.

The task id is derived from the idempotency key, so enqueueing the same key twice names the same request.
Outcomes are read from the database's request outcomes (durable, written once per key) rather than the
result backend, so a handle resolves even after the result expired or the worker that produced it died.
Publishing is blocking kombu I/O and runs in a small thread pool; waiting is pure asyncio.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from celery import Celery

from reservations import AsyncInventory, Inventory
from reservations import validation as valid
from reservations.requests import RequestResult, request_id, task_name
from tasks.app import app as default_app
from tasks.app import settings_of


class OutcomeTimeout(TimeoutError):
    def __init__(self, key: str, timeout: float) -> None:
        self.key = key
        super().__init__(f"no final outcome for {key!r} within {timeout}s")


def _poll_intervals() -> Callable[[], float]:
    delay = [0.005]

    def step() -> float:
        current = delay[0]
        delay[0] = min(current * 1.5, 0.25)
        return current

    return step


def _reservation(sku: str, quantity: int, hold_for: float | None) -> dict[str, Any]:
    """A reserve request's payload, refused before publishing if it could never succeed."""
    return {
        "sku": valid.sku(sku),
        "quantity": valid.quantity(quantity),
        "hold_for": valid.hold_seconds(hold_for),
    }


@dataclass(frozen=True)
class ReservationHandle:
    key: str
    task_id: str
    client: ReservationClient

    async def result(self, timeout: float = 30.0) -> RequestResult:
        return await self.client.wait(self.key, timeout=timeout)

    def result_sync(self, timeout: float = 30.0) -> RequestResult:
        return self.client.wait_sync(self.key, timeout=timeout)


class ReservationClient:
    """Producer side. Create one per process (or per event loop for the async methods) and close it."""

    def __init__(self, app: Celery | None = None) -> None:
        self.app = app or default_app
        self.settings = settings_of(self.app)
        self._publisher = ThreadPoolExecutor(max_workers=4, thread_name_prefix="enqueue")
        self._async_inventory: AsyncInventory | None = None
        self._inventory: Inventory | None = None

    # -- publishing ---------------------------------------------------------------------------------

    def _send(self, name: str, key: str, kwargs: dict[str, Any]) -> ReservationHandle:
        task_id = request_id(key)  # also validates the key, before anything is published
        self.app.send_task(name, kwargs={**kwargs, "idempotency_key": key}, task_id=task_id)
        return ReservationHandle(key=key, task_id=task_id, client=self)

    async def _send_async(self, name: str, key: str, kwargs: dict[str, Any]) -> ReservationHandle:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._publisher, self._send, name, key, kwargs)

    def enqueue_reservation_sync(
        self, sku: str, quantity: int, *, idempotency_key: str, hold_for: float | None = None
    ) -> ReservationHandle:
        return self._send(task_name("reserve"), idempotency_key, _reservation(sku, quantity, hold_for))

    async def enqueue_reservation(
        self, sku: str, quantity: int, *, idempotency_key: str, hold_for: float | None = None
    ) -> ReservationHandle:
        return await self._send_async(
            task_name("reserve"), idempotency_key, _reservation(sku, quantity, hold_for)
        )

    async def enqueue_order(
        self, lines: list[tuple[str, int]], *, idempotency_key: str, hold_for: float | None = None
    ) -> ReservationHandle:
        order = valid.order_lines(lines)
        valid.idempotency_key(idempotency_key)
        hold_for = valid.hold_seconds(hold_for)
        return await self._send_async(
            task_name("reserve_order"),
            idempotency_key,
            {"lines": [list(line) for line in order], "hold_for": hold_for},
        )

    def enqueue_sync(self, operation: str, *, idempotency_key: str, **kwargs: Any) -> ReservationHandle:
        """Any request by task operation name: reserve, reserve_order, confirm, release, restock."""
        valid.idempotency_key(idempotency_key)
        return self._send(task_name(operation), idempotency_key, kwargs)

    async def enqueue(self, operation: str, *, idempotency_key: str, **kwargs: Any) -> ReservationHandle:
        valid.idempotency_key(idempotency_key)
        return await self._send_async(task_name(operation), idempotency_key, kwargs)

    # -- waiting ------------------------------------------------------------------------------------

    async def wait(self, key: str, *, timeout: float = 30.0) -> RequestResult:
        if self._async_inventory is None:
            self._async_inventory = AsyncInventory.from_url(self.settings.database_url)
        deadline = time.monotonic() + timeout
        pause = _poll_intervals()
        while True:
            found = await self._async_inventory.request_outcome(key)
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                raise OutcomeTimeout(key, timeout)
            await asyncio.sleep(min(pause(), max(0.0, deadline - time.monotonic())))

    def wait_sync(self, key: str, *, timeout: float = 30.0) -> RequestResult:
        if self._inventory is None:
            self._inventory = Inventory.from_url(self.settings.database_url)
        deadline = time.monotonic() + timeout
        pause = _poll_intervals()
        while True:
            found = self._inventory.request_outcome(key)
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                raise OutcomeTimeout(key, timeout)
            time.sleep(min(pause(), max(0.0, deadline - time.monotonic())))

    async def aclose(self) -> None:
        if self._async_inventory is not None:
            await self._async_inventory.close()
            self._async_inventory = None
        self.close()

    def close(self) -> None:
        if self._inventory is not None:
            self._inventory.close()
            self._inventory = None
        self._publisher.shutdown(wait=False)


_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ReservationClient] = (
    weakref.WeakKeyDictionary()
)


def _default_client() -> ReservationClient:
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        client = _clients[loop] = ReservationClient()
    return client


async def enqueue_reservation(
    sku: str, quantity: int, *, idempotency_key: str, hold_for: float | None = None
) -> ReservationHandle:
    """``handle = await enqueue_reservation(...)``; ``outcome = await handle.result(timeout=...)``."""
    return await _default_client().enqueue_reservation(
        sku, quantity, idempotency_key=idempotency_key, hold_for=hold_for
    )
