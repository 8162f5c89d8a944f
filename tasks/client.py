"""Enqueue requests and await their outcomes, from asyncio services or from plain scripts.

The task id is derived from the idempotency key, so enqueueing the same key twice names the same request.
Outcomes are read from the database's request outcomes (durable, written once per key) rather than the
result backend, so a handle resolves even after the result expired or the worker that produced it died,
and publishing needs only the broker. An outcome stored under the key by a different request (same key,
other arguments) raises :class:`IdempotencyConflict` instead of being handed over.
Publishing is blocking kombu I/O: the event loop only queues a message, and one thread publishes the
queue in batches on one broker connection. Waiting is pure asyncio: one watcher per event loop reads
the outcomes of every awaited key at once (tasks.outcomes). A handle awaited past
``RESERVATIONS_REPUBLISH_AFTER`` without an outcome has its request published again under the same key
(a broker failover may have lost it), through the same thread; ``result_sync`` does so itself.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from celery import Celery
from kombu.exceptions import OperationalError

from reservations import AsyncInventory, IdempotencyConflict, InvalidRequest, Inventory, counting
from reservations import validation as valid
from reservations.messages import SHAPES, request_fingerprint
from reservations.requests import RequestResult, request_id
from tasks import redrives
from tasks.app import app as default_app
from tasks.app import settings_of
from tasks.errors import ClientClosed, OutcomeTimeout
from tasks.outcomes import OutcomeWatcher, Published, republish_due
from tasks.producer import Producer

log = logging.getLogger("tasks.client")


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


def _count(sku: str, counted: int) -> dict[str, Any]:
    return {"sku": valid.sku(sku), "counted": counting.counted_units(counted)}


def _replenishment(sku: str, par: int) -> dict[str, Any]:
    return {"sku": valid.sku(sku), "par": counting.par_units(par)}


def _known(operation: str) -> str:
    if operation not in SHAPES:
        raise InvalidRequest(
            f"unknown operation {operation!r}; one of {', '.join(sorted(SHAPES))}", field="operation"
        )
    return operation


@dataclass(frozen=True, slots=True)
class _Outgoing:
    """A message queued for the publishing thread, and where to tell its sender the task id."""

    name: str
    key: str
    kwargs: dict[str, Any]
    future: asyncio.Future[str]
    loop: asyncio.AbstractEventLoop
    enqueued_at: float | None = None  # a copy's: when its request was first enqueued
    deadline: float | None = None


def _settle(future: asyncio.Future[str], sent: str | None, error: BaseException | None) -> None:
    if future.done():  # its sender was cancelled; the message went out all the same
        return
    if error is not None:
        future.set_exception(error)
    elif sent is not None:
        future.set_result(sent)
    else:  # pragma: no cover - the publisher answers a message id or an error
        future.set_exception(RuntimeError("the message was neither sent nor refused"))


def _republished(key: str, since: float, error: BaseException | None) -> None:
    """Say how publishing a request again went; its error is nobody's to raise (the wait goes on, and
    the next due time tries again)."""
    if error is not None:
        log.warning("could not publish %s again after %.1fs without an outcome: %s", key, since, error)
    else:
        log.warning("published %s again: no outcome %.1fs after it was published", key, since)


def _unsent(error: Exception) -> Exception:
    """The error of a message left unsent because another of its batch found no broker connection."""
    if not isinstance(error, OperationalError):
        return error
    own = OperationalError(*error.args)
    own.__cause__ = error
    return own


@dataclass(frozen=True)
class ReservationHandle:
    """One enqueued request. ``result`` raises :class:`IdempotencyConflict` when the outcome under its key
    belongs to a different request (the key was used first with other arguments)."""

    key: str
    task_id: str
    client: ReservationClient
    operation: str | None = None
    fingerprint: str | None = None
    # What was published, to publish it again while it has no outcome (None: never).
    published: Published | None = field(default=None, compare=False, repr=False)

    async def result(self, timeout: float = 30.0) -> RequestResult:
        return self._own(await self.client.wait(self.key, timeout=timeout, published=self.published))

    def result_sync(self, timeout: float = 30.0) -> RequestResult:
        return self._own(self.client.wait_sync(self.key, timeout=timeout, published=self.published))

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
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="enqueue")
        self._outbox: list[_Outgoing] = []
        self._outbox_lock = threading.Lock()
        self._draining = False
        self._closed = False
        # Per event loop: its watcher and the connection pool it reads through (both belong to the loop).
        self._watchers: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, tuple[OutcomeWatcher, AsyncInventory]
        ] = weakref.WeakKeyDictionary()
        self._inventory: Inventory | None = None

    # -- publishing ---------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed("the client is closed")

    def _send(
        self, name: str, key: str, kwargs: dict[str, Any], deadline: float | None = None
    ) -> ReservationHandle:
        self._check_open()
        task_id = self._producer.send(name, key, kwargs, deadline=deadline)  # checks key and deadline
        return self._handle(name, key, kwargs, task_id, deadline)

    def _handle(
        self, name: str, key: str, kwargs: dict[str, Any], task_id: str, deadline: float | None = None
    ) -> ReservationHandle:
        return ReservationHandle(
            key=key,
            task_id=task_id,
            client=self,
            operation=SHAPES[name].operation,
            fingerprint=request_fingerprint(name, kwargs),
            published=Published(name, kwargs, time.monotonic(), time.time(), deadline),
        )

    async def _send_async(
        self, name: str, key: str, kwargs: dict[str, Any], deadline: float | None = None
    ) -> ReservationHandle:
        """Queue the message for the publishing thread and await its publication. Requests enqueued
        while a batch is going out wait for the next one: a batch goes out on one producer, one broker
        connection, in the thread, so the event loop only appends to a list and awaits a future."""
        valid.idempotency_key(key)
        valid.deadline(deadline)
        loop = asyncio.get_running_loop()
        sent: asyncio.Future[str] = loop.create_future()
        self._queue(_Outgoing(name, key, kwargs, sent, loop, deadline=deadline))
        return self._handle(name, key, kwargs, await sent, deadline)

    def _queue(self, item: _Outgoing) -> None:
        """Append ``item`` to the outbox, starting the publishing thread if it is idle."""
        with self._outbox_lock:
            self._check_open()
            self._outbox.append(item)
            start, self._draining = not self._draining, True
            if start:
                # Under the lock: close() cannot shut the thread down between the check and this.
                item.loop.run_in_executor(self._publisher, self._drain)

    def _republish(self, key: str, published: Published) -> None:
        """The outcome watcher found ``key`` due (tasks.outcomes.republish_due): queue its request again,
        same key, task id and arguments, for the publishing thread. Called in the watcher's event loop."""
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        sent: asyncio.Future[str] = loop.create_future()
        since = time.monotonic() - published.at
        sent.add_done_callback(
            lambda done: _republished(key, since, None if done.cancelled() else done.exception())
        )
        self._queue(
            _Outgoing(
                published.name,
                key,
                dict(published.kwargs),
                sent,
                loop,
                published.enqueued_at,
                published.deadline,
            )
        )

    def _drain(self) -> None:
        """The publishing thread: send what is queued, batch after batch, until the outbox is empty."""
        while True:
            with self._outbox_lock:
                batch, self._outbox = self._outbox, []
                if not batch:
                    self._draining = False
                    return
            answers: list[tuple[_Outgoing, str | None, BaseException | None]] = []
            try:
                with self._producer.batch() as producer:
                    for item in batch:
                        try:
                            task_id = self._producer.send(
                                item.name,
                                item.key,
                                item.kwargs,
                                producer=producer,
                                enqueued_at=item.enqueued_at,
                                deadline=item.deadline,
                            )
                            answers.append((item, task_id, None))
                        except OperationalError:
                            raise
                        except Exception as exc:  # this message only (it could not be encoded)
                            answers.append((item, None, exc))
            except Exception as exc:
                # No broker connection, after the publish retries of one message (about 0.6 s): the rest
                # of the batch would wait as long each, so its senders hear of it now, each with an
                # error of its own (a sender's raise adds to the error's traceback).
                unsent = batch[len(answers) :]
                answers.extend((item, None, exc if n == 0 else _unsent(exc)) for n, item in enumerate(unsent))
            for item, answer, error in answers:
                with suppress(RuntimeError):  # its loop closed meanwhile: nobody awaits it any more
                    item.loop.call_soon_threadsafe(_settle, item.future, answer, error)

    # Every enqueue takes ``deadline``: seconds since the epoch after which a worker that takes the
    # request up ends it ``expired``, touching no stock (tasks.deadlines). It is no part of the request:
    # the same key sent with another deadline names the same request.

    def enqueue_reservation_sync(
        self,
        sku: str,
        quantity: int,
        *,
        idempotency_key: str,
        hold_for: float | None = None,
        deadline: float | None = None,
    ) -> ReservationHandle:
        return self._send("reserve", idempotency_key, _reservation(sku, quantity, hold_for), deadline)

    async def enqueue_reservation(
        self,
        sku: str,
        quantity: int,
        *,
        idempotency_key: str,
        hold_for: float | None = None,
        deadline: float | None = None,
    ) -> ReservationHandle:
        reservation = _reservation(sku, quantity, hold_for)
        return await self._send_async("reserve", idempotency_key, reservation, deadline)

    async def enqueue_order(
        self,
        lines: list[tuple[str, int]],
        *,
        idempotency_key: str,
        hold_for: float | None = None,
        deadline: float | None = None,
    ) -> ReservationHandle:
        order = valid.order_lines(lines)
        valid.idempotency_key(idempotency_key)
        hold_for = valid.hold_seconds(hold_for)
        return await self._send_async(
            "reserve_order",
            idempotency_key,
            {"lines": [list(line) for line in order], "hold_for": hold_for},
            deadline,
        )

    def enqueue_count_sync(
        self, sku: str, counted: int, *, idempotency_key: str, deadline: float | None = None
    ) -> ReservationHandle:
        """A cycle count: the worker reads the SKU's stock under its lease and sets on hand to ``counted``
        (``enqueue_sync("count", shrinkage=...)`` has it count what it read less the shrinkage)."""
        return self._send("count", idempotency_key, _count(sku, counted), deadline)

    async def enqueue_count(
        self, sku: str, counted: int, *, idempotency_key: str, deadline: float | None = None
    ) -> ReservationHandle:
        return await self._send_async("count", idempotency_key, _count(sku, counted), deadline)

    def enqueue_replenish_sync(
        self, sku: str, *, par: int, idempotency_key: str, deadline: float | None = None
    ) -> ReservationHandle:
        """Replenishment to par: the worker reads on hand under its lease and books par minus it."""
        return self._send("replenish", idempotency_key, _replenishment(sku, par), deadline)

    async def enqueue_replenish(
        self, sku: str, *, par: int, idempotency_key: str, deadline: float | None = None
    ) -> ReservationHandle:
        return await self._send_async("replenish", idempotency_key, _replenishment(sku, par), deadline)

    def enqueue_sync(
        self, operation: str, *, idempotency_key: str, deadline: float | None = None, **kwargs: Any
    ) -> ReservationHandle:
        """Any request by task operation name: reserve, reserve_order, confirm, release, restock,
        count, replenish."""
        valid.idempotency_key(idempotency_key)
        return self._send(_known(operation), idempotency_key, kwargs, deadline)

    async def enqueue(
        self, operation: str, *, idempotency_key: str, deadline: float | None = None, **kwargs: Any
    ) -> ReservationHandle:
        valid.idempotency_key(idempotency_key)
        return await self._send_async(_known(operation), idempotency_key, kwargs, deadline)

    # -- driving dead letters again ------------------------------------------------------------------

    def redrive_sync(self, key: str, *, by: str | None = None) -> ReservationHandle:
        """Drive the dead-lettered request under ``key`` again as a new request (``<key>~redrive-<n>``,
        same operation and arguments): refused with :class:`RedriveRefused` unless it may be now. The
        handle is the new request's; ``key`` itself reports its outcome once it has one."""
        self._check_open()
        claimed = redrives.redrive(self._sync_inventory(), self._producer, key, by=by)
        return self._handle(
            claimed.request_type, claimed.key, dict(claimed.arguments), request_id(claimed.key)
        )

    async def redrive(self, key: str, *, by: str | None = None) -> ReservationHandle:
        self._check_open()
        inventory = self._async_inventory()
        claimed = await inventory.claim_redrive(key, by=by)
        try:
            return await self._send_async(claimed.request_type, claimed.key, dict(claimed.arguments))
        except BaseException:
            await inventory.drop_redrive(claimed.key)
            raise

    # -- waiting ------------------------------------------------------------------------------------

    async def wait(
        self, key: str, *, timeout: float = 30.0, published: Published | None = None
    ) -> RequestResult:
        """The key's final outcome, awaited with every other key this client awaits in its event loop:
        one watcher reads them all in one query per look (see tasks.outcomes). ``published``: what this
        client published for the key (a handle's), published again while it has no outcome."""
        valid.idempotency_key(key)
        return await self._outcome_watcher().wait(key, timeout, published=published)

    def _sync_inventory(self) -> Inventory:
        if self._inventory is None:
            self._inventory = Inventory.from_url(
                self.settings.database_url, pooling=self.settings.database_pooling
            )
        return self._inventory

    def _async_inventory(self) -> AsyncInventory:
        return self._watched()[1]

    def _outcome_watcher(self) -> OutcomeWatcher:
        return self._watched()[0]

    def _watched(self) -> tuple[OutcomeWatcher, AsyncInventory]:
        """This event loop's outcome watcher and the connection pool it reads through."""
        self._check_open()
        loop = asyncio.get_running_loop()
        found = self._watchers.get(loop)
        if found is None:
            inventory = AsyncInventory.from_url(
                self.settings.database_url, pooling=self.settings.database_pooling
            )
            watcher = OutcomeWatcher(
                inventory.request_outcomes,
                republish=self._republish,
                republish_after=self.settings.republish_after,
            )
            found = self._watchers[loop] = (watcher, inventory)
        return found

    def wait_sync(
        self, key: str, *, timeout: float = 30.0, published: Published | None = None
    ) -> RequestResult:
        """As :meth:`wait`, polling from this thread, which also publishes the request again when due."""
        self._check_open()
        inventory = self._sync_inventory()
        deadline = time.monotonic() + timeout
        pause = _poll_intervals()
        last: float | None = None
        while True:
            found = inventory.request_outcome(key)
            if found is not None:
                return found
            now = time.monotonic()
            if now >= deadline:
                raise OutcomeTimeout(key, timeout)
            if published is not None and republish_due(
                published.at, last, now, False, self.settings.republish_after
            ):
                last = now
                self._republish_sync(key, published)
            time.sleep(min(pause(), max(0.0, deadline - time.monotonic())))

    def _republish_sync(self, key: str, published: Published) -> None:
        since = time.monotonic() - published.at
        error = None
        try:
            self._producer.send(
                published.name,
                key,
                dict(published.kwargs),
                enqueued_at=published.enqueued_at,
                deadline=published.deadline,
            )
        except Exception as exc:
            error = exc
        _republished(key, since, error)

    async def aclose(self) -> None:
        """Close the client: the outcome watcher of this event loop stops (handles still waiting get
        ``WatcherClosed``) and its connection pool closes, then the publishing thread and the broker
        connections. A client awaited from other event loops too is closed from each of them."""
        found = self._watchers.pop(asyncio.get_running_loop(), None)
        if found is not None:
            watcher, inventory = found
            await watcher.aclose()
            await inventory.close()
        self.close()

    async def __aenter__(self) -> ReservationClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> ReservationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the publishing side and the sync connections; later enqueues raise ``ClientClosed``
        (``aclose`` also stops the event loop's outcome watcher)."""
        with self._outbox_lock:
            self._closed = True
            left, self._outbox = self._outbox, []
        closed = ClientClosed("the client was closed before this request was published")
        for item in left:
            with suppress(RuntimeError):  # its loop closed meanwhile: nobody awaits it any more
                item.loop.call_soon_threadsafe(_settle, item.future, None, closed)
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
    sku: str,
    quantity: int,
    *,
    idempotency_key: str,
    hold_for: float | None = None,
    deadline: float | None = None,
) -> ReservationHandle:
    """``handle = await enqueue_reservation(...)``; ``outcome = await handle.result(timeout=...)``."""
    return await _default_client().enqueue_reservation(
        sku, quantity, idempotency_key=idempotency_key, hold_for=hold_for, deadline=deadline
    )
