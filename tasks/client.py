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
loop: one thread records and publishes in batches (:class:`Outbox`), and one watcher per event loop reads
every awaited key at once (:class:`OutcomeWatcher`). The relay (tasks.relay) publishes again a recorded
request whose message was lost, so nothing here publishes twice.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from celery import Celery
from kombu.exceptions import BatchPublishError, OperationalError

from reservations import AsyncInventory, IdempotencyConflict, Inventory
from reservations import validation as valid
from reservations.acceptance import Admission, Request
from reservations.errors import InvalidRequest
from reservations.redrives import is_redrive_key
from reservations.request_outcomes import MAX_KEYS_PER_READ, RequestResult
from tasks import messages, tracing
from tasks.app import app as default_app
from tasks.errors import BrokerUnavailable, ClientClosed, OutcomeTimeout, WatcherClosed
from tasks.producer import Producer, Sender, request_of
from tasks.settings import settings_of
from tasks.tracing import Trace

__all__ = ["ReservationClient", "ReservationHandle", "enqueue_reservation"]

log = logging.getLogger("tasks.client")
T = TypeVar("T")
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


Read = Callable[[Sequence[str]], Awaitable[dict[str, RequestResult]]]


class OutcomeWatcher:
    """Reads the outcomes of every key awaited in one event loop, in one query per look, on one connection.

    The outcome row is the truth and a look is a plain read of it: an outcome written by any worker, a
    batch server, the relay or the beat sweep resolves its handles alike. A new key brings the next look
    within ``FIRST`` seconds; while looks find nothing the pace slows to ``SLOWEST``. Timeouts and
    cancellation remove a waiter at once; the watcher stops when nobody waits.
    """

    FIRST = 0.005
    SLOWEST = 0.1
    # A look at every waiting key is followed by a pause of at least this many times its own length: with
    # thousands waiting, a look costs the event loop milliseconds, and looks back to back (a key arriving
    # every few milliseconds asks for the next) would leave the loop nothing else. Keys that arrived since
    # the last look are looked at on their own in between, so a new request still hears within FIRST.
    SPACING = 3.0

    def __init__(self, read: Read) -> None:
        self._read = read
        self._waiting: dict[str, list[asyncio.Future[RequestResult]]] = {}
        self._fresh: set[str] = set()  # keys that arrived since the last look
        self._task: asyncio.Task[None] | None = None
        self._news: asyncio.Event | None = None
        self._closed = False

    @property
    def waiting(self) -> int:
        """Keys with at least one waiter."""
        return len(self._waiting)

    async def wait(self, key: str, timeout: float) -> RequestResult:
        """The key's outcome, within ``timeout`` seconds (:class:`OutcomeTimeout` past it)."""
        if self._closed:
            raise WatcherClosed("the client is closed")
        future: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, []).append(future)
        self._fresh.add(key)
        self._start()
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise OutcomeTimeout(key, timeout) from None
        finally:
            waiters = self._waiting.get(key)  # None once a look or aclose settled the key
            if waiters is not None:
                with suppress(ValueError):
                    waiters.remove(future)
                if not waiters:
                    del self._waiting[key]

    def _start(self) -> None:
        if self._news is None:
            self._news = asyncio.Event()
        self._news.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="outcome-watcher")

    async def _watch(self) -> None:
        assert self._news is not None
        pause = self.FIRST  # FIRST after a look that found outcomes or after new keys, growing otherwise
        # Paced on the event loop's clock, as its sleeps are.
        ticks = asyncio.get_running_loop().time
        spaced_until = ticks()  # no look at every key before this: SPACING times the last one's length
        while self._waiting:
            if self._news.is_set():
                # Keys keep arriving in a burst: gather them for one look instead of a look each.
                self._news.clear()
                pause = self.FIRST
                await asyncio.sleep(self.FIRST)
            began = ticks()
            if began >= spaced_until:
                keys, every = list(self._waiting), True
            else:  # too soon after the last look at every key: the new keys only
                keys, every = [k for k in self._fresh if k in self._waiting], False
            self._fresh.clear()
            found = await self._look(keys) if keys else 0
            if every:
                spaced_until = ticks() + self.SPACING * (ticks() - began)
            pause = self.FIRST if found else min(pause * 1.5, self.SLOWEST)
            with suppress(TimeoutError):
                await asyncio.wait_for(self._news.wait(), max(pause, spaced_until - ticks()))

    async def _look(self, keys: list[str]) -> int:
        """Read the keys' outcomes and hand each to its waiters; returns how many were resolved."""
        resolved = 0
        for start in range(0, len(keys), MAX_KEYS_PER_READ):
            chunk = keys[start : start + MAX_KEYS_PER_READ]
            try:
                found = await self._read(chunk)
            except Exception as exc:
                # As when each handle read for itself: the waiters of this look get the error (an
                # unreachable database is BackendUnavailable) instead of waiting out their timeouts.
                log.warning("could not read %d outcomes: %s", len(chunk), exc)
                for key in chunk:
                    self._settle(key, error=exc)
                continue
            for n, (key, result) in enumerate(found.items(), 1):
                resolved += self._settle(key, result=result)
                if n % SETTLED_PER_TURN == 0:
                    await asyncio.sleep(0)  # the woken handlers run, and the loop looks at its sockets
        return resolved

    def _settle(
        self, key: str, *, result: RequestResult | None = None, error: BaseException | None = None
    ) -> int:
        # A copy of the error each: one instance raised in many tasks would collect all their tracebacks.
        waiters = self._waiting.pop(key, [])
        return sum(_settle(future, result, None if error is None else copied(error)) for future in waiters)

    async def aclose(self) -> None:
        """Stop watching; handles still waiting get :class:`WatcherClosed`."""
        self._closed = True
        for key in list(self._waiting):
            self._settle(key, error=WatcherClosed("the client was closed"))
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def _settle(future: asyncio.Future[T], result: T | None, error: BaseException | None) -> bool:
    """Resolve ``future`` with ``error``, else ``result``, unless it is done: its awaiter timed out or was
    cancelled (a message sent meanwhile went out all the same)."""
    if future.done():
        return False
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(cast(T, result))
    return True


def copied(error: BaseException) -> BaseException:
    """The same error as a new instance (same type, arguments and attributes), caused by the original."""
    kind = type(error)
    copied = kind.__new__(kind)
    copied.args = error.args
    copied.__dict__.update(vars(error))
    copied.__cause__ = error
    return copied


# What the publishing thread does with a request before it publishes it: records it (an enqueue), nothing
# (recorded already), or admits it under its key (the front door's), publishing it only when it is the
# first request there.
RECORD, RECORDED, ADMIT = "record", "recorded", "admit"


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A request queued for the publishing thread, its ``step`` before publishing, and where to tell its
    sender the task id (or, for one admitted, what :class:`Admitted` says)."""

    request: Request
    step: str
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    trace: Trace | None


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request the publishing thread admitted: what its key held (``admission``) and, when it was the
    first request under its key, its publication: the ``task_id``, or the error that left it recorded but
    unpublished (``unpublished``: the relay publishes it)."""

    admission: Admission
    task_id: str | None = None
    unpublished: BaseException | None = None


def _first(admission: Admission | None) -> bool:
    return admission is not None and admission.first


# A sender's future and what it is told: the answer, or the error.
Told = tuple["asyncio.Future[Any]", Any, BaseException | None]

# Futures settled in one turn of their event loop at most: the senders of a whole batch woken in one turn
# would run their handlers back to back, and a request answered meanwhile (a health check) would wait for
# all of them.
SETTLED_PER_TURN = 8


def _settle_few(loop: asyncio.AbstractEventLoop, told: list[Told]) -> None:
    """Settle the first :data:`SETTLED_PER_TURN` of ``told`` now and the rest in the loop's next turns."""
    for future, answer, error in told[:SETTLED_PER_TURN]:
        _settle(future, answer, error)
    if len(told) > SETTLED_PER_TURN:
        loop.call_soon(_settle_few, loop, told[SETTLED_PER_TURN:])


def _tell(answers: Iterable[tuple[Outgoing, Any, BaseException | None]]) -> None:
    """Tell senders their answers from the publishing thread: one call into each sender's event loop,
    which settles them a few per turn (:func:`_settle_few`)."""
    told: dict[asyncio.AbstractEventLoop, list[Told]] = {}
    for item, answer, error in answers:
        told.setdefault(item.loop, []).append((item.future, answer, error))
    for loop, each in told.items():
        with suppress(RuntimeError):  # its loop closed meanwhile: nobody awaits it any more
            loop.call_soon_threadsafe(_settle_few, loop, each)


# A message of a batch and what its sender hears: its task id, or the error it met.
Answer = tuple[Outgoing, str | None, BaseException | None]


class Outbox:
    """The async shell's publishing thread: event loops queue requests for ``sender``, and one thread takes
    what is queued, batch after batch, records the batch's requests in one statement, then publishes each
    on one pooled producer (one broker connection), and settles each sender's future in its own loop.
    Requests enqueued while a batch is going out wait for the next one."""

    def __init__(self, sender: Sender) -> None:
        self._sender = sender
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="enqueue")
        self._queued: list[Outgoing] = []
        self._lock = threading.Lock()
        self._draining = False
        self._closed = False

    async def publish(self, request: Request, *, recorded: bool = False, trace: Trace | None = None) -> str:
        """Queue ``request`` (its message naming ``trace`` as the worker's parent span), starting the
        publishing thread if it is idle, and await its record and publication; returns its task id."""
        task_id: str = await self._queue(request, RECORDED if recorded else RECORD, trace)
        return task_id

    async def admit(self, request: Request, *, trace: Trace | None = None) -> Admitted:
        """Queue ``request`` to be admitted under its key with what else is queued, and published when it
        is the first request there."""
        admitted: Admitted = await self._queue(request, ADMIT, trace)
        return admitted

    async def _queue(self, request: Request, step: str, trace: Trace | None) -> Any:
        loop = asyncio.get_running_loop()
        sent: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            if self._closed:
                raise ClientClosed("the client is closed")
            self._queued.append(Outgoing(request, step, sent, loop, trace))
            start, self._draining = not self._draining, True
            if start:
                # Under the lock: close() cannot shut the thread down between the check and this.
                loop.run_in_executor(self._publisher, self._drain)
        return await sent

    def _drain(self) -> None:
        """The publishing thread: send what is queued, batch after batch, until the outbox is empty."""
        while True:
            with self._lock:
                batch, self._queued = self._queued, []
                if not batch:
                    self._draining = False
                    return
            answers: list[Answer] = []
            try:
                if recording := [item.request for item in batch if item.step == RECORD]:
                    self._sender.record(recording)
            except Exception as exc:  # nothing of the batch is published unrecorded
                answers.extend((item, None, copied(exc)) for item in batch if item.step == RECORD)
                batch = [item for item in batch if item.step != RECORD]
            admitted = self._admit([item for item in batch if item.step == ADMIT], answers)
            # An admitted request is published only when it is the first under its key.
            batch = [item for item in batch if item.step != ADMIT or _first(admitted.get(id(item)))]
            try:
                self._publish(batch, answers)
            except Exception as exc:
                # No broker connection, after the publish retries of one message (about 0.6 s): the rest
                # of the batch would wait as long each, so its senders hear of it now, each with an
                # error of its own (a sender's raise adds to the error's traceback). Their requests are
                # recorded: the relay publishes them once the broker answers.
                answered = {id(item) for item, _, _ in answers}
                answers.extend(
                    (item, None, BrokerUnavailable.of(exc) if isinstance(exc, OperationalError) else exc)
                    for item in batch
                    if id(item) not in answered
                )
            _tell(
                (item, Admitted(admitted[id(item)], answer, error), None)
                if item.step == ADMIT and id(item) in admitted  # admitted: a publish error is its news
                else (item, answer, error)
                for item, answer, error in answers
            )

    def _admit(self, items: list[Outgoing], answers: list[Answer]) -> dict[int, Admission]:
        """Admit ``items`` in one statement (reservations.acceptance.admit_many): each item's admission by
        its id; one that is not the first under its key is answered now. When the admission fails, every
        item hears its error and none is published."""
        if not items:
            return {}
        try:
            admissions = self._sender.admit([item.request for item in items])
        except Exception as exc:
            answers.extend((item, None, copied(exc)) for item in items)
            return {}
        made = {id(item): admission for item, admission in zip(items, admissions, strict=True)}
        answers.extend((item, None, None) for item in items if not made[id(item)].first)
        return made

    def _publish(self, batch: list[Outgoing], answers: list[Answer]) -> None:
        """Publish ``batch`` on one pooled producer, adding each message's answer to ``answers``: its task
        id, or an error of its own (it could not be encoded). On Redis the pushes go in one pipeline
        (kombu's ``Producer.batch``): one round trip for the batch, and about half the publishing thread's
        CPU per message. A pipeline that fails (a pooled connection the broker dropped) leaves each push
        uncertain, so its messages are published again one by one, with kombu's retries: a second copy is
        harmless, as the relay's are (the idempotency key). Raises what a publish raises when the broker
        cannot be reached."""
        if not batch:
            return
        publish = self._sender.producer.publish
        with self._sender.producer.batch() as producer:
            pushed: list[tuple[Outgoing, str]] = []
            try:
                with producer.batch():  # RabbitMQ: published at once, as without it
                    for item in batch:
                        try:
                            pushed.append((item, publish(item.request, batch=producer, trace=item.trace)))
                        except (OperationalError, BatchPublishError):
                            raise
                        except Exception as exc:  # this message only (it could not be encoded)
                            answers.append((item, None, exc))
                answers.extend((item, sent, None) for item, sent in pushed)
            except BatchPublishError:
                answered = {id(item) for item, _, _ in answers}
                for item in batch:
                    if id(item) not in answered:
                        answers.append((item, publish(item.request, batch=producer, trace=item.trace), None))

    def close(self) -> None:
        """Publish nothing more: messages still queued are refused with ``ClientClosed``, later ones too."""
        with self._lock:
            self._closed = True
            left, self._queued = self._queued, []
        closed = ClientClosed("the client was closed before this request was published")
        _tell((item, None, closed) for item in left)
        self._publisher.shutdown(wait=False)


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
    **kwargs: Any,
) -> Asked:
    """Any request by task operation name: reserve, reserve_order, confirm, release, restock, count,
    replenish. Its arguments are sent as given (a worker refuses malformed ones)."""
    valid.idempotency_key(idempotency_key)
    return Asked(_known(operation), idempotency_key, deadline, traceparent, sent=kwargs)


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
        if sent is None:
            checked = messages.normalized(name, given)[0]
            sent = {k: [list(x) for x in v] if k == "lines" else v for k, v in checked.items() if k in given}
        self._check_open()
        valid.idempotency_key(asked.key)
        if is_redrive_key(asked.key):  # the name of a re-drive, which only `redrive` may take
            raise InvalidRequest(
                f"{asked.key!r} is a re-drive's key (<key>~redrive-<n>)", field="idempotency_key"
            )
        valid.deadline(asked.deadline)
        return request_of(name, asked.key, sent, deadline=asked.deadline)

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
