"""Enqueue requests and await their outcomes, from asyncio services or from plain scripts.

The task id is derived from the idempotency key, so enqueueing the same key twice names the same request.
Outcomes are read from the database's request outcomes (durable, written once per key) rather than the
result backend, so a handle resolves even after the result expired or the worker that produced it died,
and publishing needs only the broker. An outcome stored under the key by a different request (same key,
other arguments) raises :class:`IdempotencyConflict` instead of being handed over.
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

from reservations import AsyncInventory, IdempotencyConflict, InvalidRequest, Inventory
from reservations import validation as valid
from reservations.messages import SHAPES, request_fingerprint
from reservations.producer import Producer
from reservations.requests import RequestResult
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


def _known(operation: str) -> str:
    if operation not in SHAPES:
        raise InvalidRequest(
            f"unknown operation {operation!r}; one of {', '.join(sorted(SHAPES))}", field="operation"
        )
    return operation


@dataclass(frozen=True)
class ReservationHandle:
    """One enqueued request. ``result`` raises :class:`IdempotencyConflict` when the outcome under its key
    belongs to a different request (the key was used first with other arguments)."""

    key: str
    task_id: str
    client: ReservationClient
    operation: str | None = None
    fingerprint: str | None = None

    async def result(self, timeout: float = 30.0) -> RequestResult:
        return self._own(await self.client.wait(self.key, timeout=timeout))

    def result_sync(self, timeout: float = 30.0) -> RequestResult:
        return self._own(self.client.wait_sync(self.key, timeout=timeout))

    def _own(self, stored: RequestResult) -> RequestResult:
        if self.operation is None or self.fingerprint is None:
            return stored
        if not stored.belongs_to(self.operation, self.fingerprint):
            raise IdempotencyConflict(
                key=self.key, operation=self.operation, stored_operation=stored.operation
            )
        return stored


class ReservationClient:
    """Producer side. Create one per process (or per event loop for the async methods) and close it."""

    def __init__(self, app: Celery | None = None) -> None:
        self.app = app or default_app
        self.settings = settings_of(self.app)
        # Publishing through a producer without a result backend: the outcome is read from the database.
        self._producer = Producer(
            self.settings.broker_url, transport_options=self.app.conf.broker_transport_options
        )
        self._publisher = ThreadPoolExecutor(max_workers=4, thread_name_prefix="enqueue")
        self._async_inventory: AsyncInventory | None = None
        self._inventory: Inventory | None = None

    # -- publishing ---------------------------------------------------------------------------------

    def _send(self, name: str, key: str, kwargs: dict[str, Any]) -> ReservationHandle:
        task_id = self._producer.send(name, key, kwargs)  # validates the key before publishing
        return ReservationHandle(
            key=key,
            task_id=task_id,
            client=self,
            operation=SHAPES[name].operation,
            fingerprint=request_fingerprint(name, kwargs),
        )

    async def _send_async(self, name: str, key: str, kwargs: dict[str, Any]) -> ReservationHandle:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._publisher, self._send, name, key, kwargs)

    def enqueue_reservation_sync(
        self, sku: str, quantity: int, *, idempotency_key: str, hold_for: float | None = None
    ) -> ReservationHandle:
        return self._send("reserve", idempotency_key, _reservation(sku, quantity, hold_for))

    async def enqueue_reservation(
        self, sku: str, quantity: int, *, idempotency_key: str, hold_for: float | None = None
    ) -> ReservationHandle:
        return await self._send_async("reserve", idempotency_key, _reservation(sku, quantity, hold_for))

    async def enqueue_order(
        self, lines: list[tuple[str, int]], *, idempotency_key: str, hold_for: float | None = None
    ) -> ReservationHandle:
        order = valid.order_lines(lines)
        valid.idempotency_key(idempotency_key)
        hold_for = valid.hold_seconds(hold_for)
        return await self._send_async(
            "reserve_order",
            idempotency_key,
            {"lines": [list(line) for line in order], "hold_for": hold_for},
        )

    def enqueue_sync(self, operation: str, *, idempotency_key: str, **kwargs: Any) -> ReservationHandle:
        """Any request by task operation name: reserve, reserve_order, confirm, release, restock."""
        valid.idempotency_key(idempotency_key)
        return self._send(_known(operation), idempotency_key, kwargs)

    async def enqueue(self, operation: str, *, idempotency_key: str, **kwargs: Any) -> ReservationHandle:
        valid.idempotency_key(idempotency_key)
        return await self._send_async(_known(operation), idempotency_key, kwargs)

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
        self._producer.close()


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
