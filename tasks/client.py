"""Enqueue requests and await their outcomes, from asyncio services or from plain scripts.

The task id is derived from the idempotency key, so the same key twice names the same request. Outcomes
are read from the database's request outcomes (written once per key), not the result backend: a handle
resolves after the result expired or its worker died, and publishing needs only the broker. An outcome
stored under the key by a different request raises :class:`IdempotencyConflict` instead.

Each enqueue is written once, as a function that says what it asks for (:class:`Asked`): the client's
method of that name awaits it and its ``*_sync`` twin blocks on it. Both call one core without I/O: the
payload checked before anything is recorded, the request's record, its handle, whether a stored outcome
is the handle's own. The sync shell records and publishes from the calling thread
(:class:`tasks.producer.Sender`) and polls the key's outcome row. The async shell never blocks its event
loop: one thread records and publishes in batches (:class:`tasks.outbox.Outbox`), and one watcher per event
loop reads every awaited key at once (:class:`tasks.outcomes.OutcomeWatcher`). The relay (tasks.relay)
publishes again a recorded request whose message was lost, so nothing here publishes twice.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec

from celery import Celery
from kombu.exceptions import OperationalError

from reservations import AsyncInventory, IdempotencyConflict, Inventory
from reservations import validation as valid
from reservations.acceptance import Request
from reservations.errors import InvalidRequest
from reservations.redrives import is_redrive_key
from reservations.request_outcomes import RequestResult
from tasks import messages, tracing
from tasks.app import app as default_app
from tasks.errors import BrokerUnavailable, ClientClosed, OutcomeTimeout
from tasks.outbox import Admitted, Outbox
from tasks.outcomes import OutcomeWatcher
from tasks.producer import Producer, Sender, request_of
from tasks.settings import settings_of
from tasks.tracing import Trace

__all__ = ["ReservationClient", "ReservationHandle", "enqueue_reservation"]

P = ParamSpec("P")


def _known(operation: str) -> str:
    if operation not in messages.SHAPES:
        known = ", ".join(sorted(messages.SHAPES))
        raise InvalidRequest(f"unknown operation {operation!r}; one of {known}", field="operation")
    return operation


def _trace(traceparent: str | None) -> Trace | None:
    """The span a request's message names as its worker's parent: the caller's ``traceparent``, else the
    trace this thread or task is in (the HTTP service's span of the request it serves), else none (the
    worker starts a trace). A malformed one is refused: it is the calling code's, not a header heard."""
    if traceparent is None:
        return tracing.current.get()
    found = tracing.parse(traceparent)
    if found is None:
        raise InvalidRequest(
            f"{traceparent!r} is no W3C traceparent (00-<32 hex digits>-<16 hex digits>-<2 hex digits>, "
            "lower case, ids not all zeros)",
            field="traceparent",
        )
    return found


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
        """The outcome, when it is this request's: the one decision both shells share."""
        if self.operation is None or self.fingerprint is None:
            return stored
        if not stored.belongs_to(self.operation, self.fingerprint):
            raise IdempotencyConflict(
                key=self.key, operation=self.operation, stored_operation=stored.operation
            )
        return stored


@dataclass(frozen=True)
class Asked:
    """An enqueue as its caller asked for it, before anything is checked, recorded or sent: the task's
    name, the key, the deadline, the caller's traceparent, and the arguments (``given``, checked as a
    worker checks them, or ``sent`` as they are)."""

    name: str
    key: str
    deadline: float | None
    traceparent: str | None
    given: dict[str, Any] = field(default_factory=dict)
    sent: dict[str, Any] | None = None
    sku_hint: str | None = None


# Every enqueue takes ``deadline``: seconds since the epoch after which a worker that takes the request up
# ends it ``expired``, touching no stock (tasks.messages.late). It is no part of the request: the same key
# sent with another deadline names the same request. And ``traceparent``: the W3C traceparent of the
# caller's span, which the worker's log lines and spans continue (unset: the trace the caller is in,
# tasks.tracing.current, if any).


def reservation(
    sku: str,
    quantity: int,
    *,
    idempotency_key: str,
    hold_for: float | None = None,
    deadline: float | None = None,
    traceparent: str | None = None,
) -> Asked:
    """A reservation of ``quantity`` units of ``sku``, held ``hold_for`` seconds (the workers' hold
    unless given) until it is confirmed or released."""
    given = {"sku": sku, "quantity": quantity, "hold_for": hold_for}
    return Asked("reserve", idempotency_key, deadline, traceparent, given)


def order(
    lines: list[tuple[str, int]],
    *,
    idempotency_key: str,
    hold_for: float | None = None,
    deadline: float | None = None,
    traceparent: str | None = None,
) -> Asked:
    """An order: every line's units reserved under every line's lease, or none."""
    return Asked(
        "reserve_order", idempotency_key, deadline, traceparent, {"lines": lines, "hold_for": hold_for}
    )


def count(
    sku: str,
    counted: int,
    *,
    idempotency_key: str,
    deadline: float | None = None,
    traceparent: str | None = None,
) -> Asked:
    """A cycle count: the worker reads the SKU's stock under its lease and sets on hand to ``counted``
    (``enqueue_sync("count", shrinkage=...)`` has it count what it read less the shrinkage)."""
    return Asked("count", idempotency_key, deadline, traceparent, {"sku": sku, "counted": counted})


def replenish(
    sku: str,
    *,
    par: int,
    idempotency_key: str,
    deadline: float | None = None,
    traceparent: str | None = None,
) -> Asked:
    """Replenishment to par: the worker reads on hand under its lease and books par minus it."""
    return Asked("replenish", idempotency_key, deadline, traceparent, {"sku": sku, "par": par})


def any_request(
    operation: str,
    *,
    idempotency_key: str,
    deadline: float | None = None,
    traceparent: str | None = None,
    sku_hint: str | None = None,
    **kwargs: Any,
) -> Asked:
    """Any request by task operation name: reserve, reserve_order, confirm, release, restock, count,
    replenish. Its arguments are sent as given (a worker refuses malformed ones). ``sku_hint``: a confirm's
    or release's reservation's SKU, when the caller knows it (the reserve's outcome names it), so that the
    worker takes its lease without reading the reservation first; a wrong one costs a lease more, not the
    request."""
    valid.idempotency_key(idempotency_key)
    if sku_hint is not None:
        valid.sku(sku_hint)
    return Asked(_known(operation), idempotency_key, deadline, traceparent, sent=kwargs, sku_hint=sku_hint)


def _as_method(enqueue: Callable[..., Any], asks: Callable[..., Asked], name: str) -> None:
    """``enqueue`` dressed as ``asks`` made the client's method ``name``: its docstring, and its parameters
    after ``self``."""
    functools.update_wrapper(enqueue, asks)
    enqueue.__name__, enqueue.__qualname__ = name, f"ReservationClient.{name}"
    signature = inspect.signature(asks)
    self = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    enqueue.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[self, *signature.parameters.values()], return_annotation="ReservationHandle"
    )


def _blocking(
    asks: Callable[P, Asked], name: str
) -> Callable[Concatenate[ReservationClient, P], ReservationHandle]:
    """The client method that records and publishes, from the calling thread, what ``asks`` says."""

    def enqueue(self: ReservationClient, /, *args: P.args, **kwargs: P.kwargs) -> ReservationHandle:
        return self._send(asks(*args, **kwargs))

    _as_method(enqueue, asks, name)
    return enqueue


def _awaited(
    asks: Callable[P, Asked], name: str
) -> Callable[Concatenate[ReservationClient, P], Coroutine[Any, Any, ReservationHandle]]:
    """The client coroutine method that has the publishing thread record and publish what ``asks`` says."""

    async def enqueue(self: ReservationClient, /, *args: P.args, **kwargs: P.kwargs) -> ReservationHandle:
        return await self._queue(asks(*args, **kwargs))

    _as_method(enqueue, asks, name)
    return enqueue


class ReservationClient:
    """Producer side. Create one per process (or per event loop for the async methods) and close it."""

    def __init__(self, app: Celery | None = None) -> None:
        self.app = app or default_app
        self.settings = settings_of(self.app)
        # Publishing through a producer without a result backend: the outcome is read from the database.
        self._producer = Producer(
            self.settings.broker_url, transport_options=self.app.conf.broker_transport_options
        )
        self._sender = Sender(self._producer, self._sync_inventory, self.settings.republish_after)
        self._outbox = Outbox(self._sender)
        self._closed = False
        # Per event loop: its watcher and the connection pool it reads through (both belong to the loop).
        self._watchers: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, tuple[OutcomeWatcher, AsyncInventory]
        ] = weakref.WeakKeyDictionary()
        self._inventory: Inventory | None = None

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed("the client is closed")

    def _request(self, asked: Asked) -> Request:
        """The request asked for: ``given`` arguments checked first as a worker checks them (one that could
        never succeed is refused with :class:`InvalidRequest` here, not dead-lettered by a worker), or
        ``sent`` as they are; refused before anything is recorded for a closed client, a bad key or
        deadline."""
        name, sent, given = asked.name, asked.sent, asked.given
        print_ = None  # the fingerprint, once the arguments are checked here
        if sent is None:
            checked, print_ = messages.normalized(name, given)
            sent = {k: [list(x) for x in v] if k == "lines" else v for k, v in checked.items() if k in given}
        self._check_open()
        valid.idempotency_key(asked.key)
        if is_redrive_key(asked.key):  # the name of a re-drive, which only `redrive` may take
            raise InvalidRequest(
                f"{asked.key!r} is a re-drive's key (<key>~redrive-<n>)", field="idempotency_key"
            )
        valid.deadline(asked.deadline)
        return request_of(
            name, asked.key, sent, deadline=asked.deadline, fingerprint=print_, sku_hint=asked.sku_hint
        )

    def _handle(self, request: Request, task_id: str) -> ReservationHandle:
        return ReservationHandle(request.key, task_id, self, request.operation, request.fingerprint)

    def _send(self, asked: Asked) -> ReservationHandle:
        """The blocking shell of every enqueue: recorded and published from the calling thread."""
        trace = _trace(asked.traceparent)
        request = self._request(asked)
        try:
            task_id = self._sender.send(request, trace)
        except OperationalError as exc:  # recorded: the relay publishes it once the broker answers
            raise BrokerUnavailable.of(exc) from exc
        return self._handle(request, task_id)

    async def _queue(self, asked: Asked) -> ReservationHandle:
        """The async shell of every enqueue: recorded and published by the publishing thread, in batches."""
        trace = _trace(asked.traceparent)
        request = self._request(asked)
        return self._handle(request, await self._outbox.publish(request, trace=trace))

    async def publish_recorded(
        self, request: Request, *, traceparent: str | None = None
    ) -> ReservationHandle:
        """Publish a request its caller recorded already."""
        trace = _trace(traceparent)
        self._check_open()
        return self._handle(request, await self._outbox.publish(request, recorded=True, trace=trace))

    async def admit(self, request: Request, *, traceparent: str | None = None) -> Admitted:
        """Admit ``request`` under its key (:func:`reservations.acceptance.admit`: recorded unless the key
        has an outcome or a record) and publish it when it is the first request there: the front door's
        every request. The publishing thread admits what arrived meanwhile in one statement, and publishes
        the batch's first requests in one round trip; a publish that fails leaves the request recorded,
        and :class:`Admitted` says so."""
        trace = _trace(traceparent)
        self._check_open()
        request.given()  # checked here: a request that cannot be recorded fails alone, not its batch
        return await self._outbox.admit(request, trace=trace)

    # Each enqueue is written once, as what it asks for (the functions below the class); ``name`` awaits
    # it and ``name_sync`` blocks on it.
    enqueue_reservation = _awaited(reservation, "enqueue_reservation")
    enqueue_reservation_sync = _blocking(reservation, "enqueue_reservation_sync")
    enqueue_order = _awaited(order, "enqueue_order")
    enqueue_count = _awaited(count, "enqueue_count")
    enqueue_count_sync = _blocking(count, "enqueue_count_sync")
    enqueue_replenish = _awaited(replenish, "enqueue_replenish")
    enqueue_replenish_sync = _blocking(replenish, "enqueue_replenish_sync")
    enqueue = _awaited(any_request, "enqueue")
    enqueue_sync = _blocking(any_request, "enqueue_sync")

    def redrive_sync(self, key: str, *, by: str | None = None) -> ReservationHandle:
        """Drive the dead-lettered request under ``key`` again as a new request (``<key>~redrive-<n>``,
        same operation and arguments): refused with :class:`RedriveRefused` unless it may be now. The
        handle is the new request's; ``key`` itself reports its outcome once it has one."""
        self._check_open()
        try:
            claimed, task_id = self._sender.redrive(key, by=by)
        except OperationalError as exc:
            raise BrokerUnavailable.of(exc) from exc
        return self._handle(request_of(claimed.request_type, claimed.key, claimed.arguments), task_id)

    async def redrive(self, key: str, *, by: str | None = None) -> ReservationHandle:
        # The same claim and record as Sender.redrive, the record written by the publishing thread.
        self._check_open()
        inventory = self._watched()[1]
        claimed = await inventory.claim_redrive(key, by=by)
        request = request_of(claimed.request_type, claimed.key, claimed.arguments)
        try:
            return self._handle(request, await self._outbox.publish(request))
        except BrokerUnavailable:
            raise  # recorded: the relay publishes it once the broker answers
        except BaseException:
            await inventory.drop_redrive(claimed.key)
            raise

    async def wait(self, key: str, *, timeout: float = 30.0) -> RequestResult:
        """The key's final outcome, awaited with every other key this client awaits in its event loop:
        one watcher reads them all in one query per look (:class:`OutcomeWatcher`)."""
        valid.idempotency_key(key)
        return await self._watched()[0].wait(key, timeout)

    def wait_sync(self, key: str, *, timeout: float = 30.0) -> RequestResult:
        """As :meth:`wait`, polling from this thread."""
        self._check_open()
        valid.idempotency_key(key)
        inventory = self._sync_inventory()
        deadline = time.monotonic() + timeout
        pause = 0.005  # growing to 0.25 s
        while True:
            found = inventory.request_outcome(key)
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                raise OutcomeTimeout(key, timeout)
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 1.5, 0.25)

    def _sync_inventory(self) -> Inventory:
        if self._inventory is None:
            self._inventory = Inventory.from_url(
                self.settings.database_url, pooling=self.settings.database_pooling
            )
        return self._inventory

    def _watched(self) -> tuple[OutcomeWatcher, AsyncInventory]:
        """This event loop's outcome watcher and the connection pool it reads through."""
        self._check_open()
        loop = asyncio.get_running_loop()
        found = self._watchers.get(loop)
        if found is None:
            inventory = AsyncInventory.from_url(
                self.settings.database_url, pooling=self.settings.database_pooling
            )
            watcher = OutcomeWatcher(inventory.request_outcomes)
            found = self._watchers[loop] = (watcher, inventory)
        return found

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
        self._closed = True
        self._outbox.close()
        if self._inventory is not None:
            self._inventory.close()
            self._inventory = None
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
    traceparent: str | None = None,
) -> ReservationHandle:
    """``handle = await enqueue_reservation(...)``; ``outcome = await handle.result(timeout=...)``."""
    return await _default_client().enqueue_reservation(
        sku, quantity, idempotency_key=idempotency_key, hold_for=hold_for, deadline=deadline,
        traceparent=traceparent,
    )  # fmt: skip
