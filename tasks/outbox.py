"""The async client's publishing thread: event loops queue requests, and one thread records or admits and
publishes them in batches, then tells each sender its answer in the sender's own event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from kombu.exceptions import BatchPublishError, OperationalError

from reservations.acceptance import Admission, Request
from tasks.errors import BrokerUnavailable, ClientClosed
from tasks.outcomes import SETTLED_PER_TURN, copied, settle
from tasks.producer import Sender
from tasks.tracing import Trace

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


def _settle_few(loop: asyncio.AbstractEventLoop, told: list[Told]) -> None:
    """Settle the first :data:`SETTLED_PER_TURN` of ``told`` now and the rest in the loop's next turns."""
    for future, answer, error in told[:SETTLED_PER_TURN]:
        settle(future, answer, error)
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
    what is queued, batch after batch, records (or admits) the batch's requests in one statement, then
    publishes each on one pooled producer (one broker connection), and settles each sender's future in its
    own loop. Requests enqueued while a batch is going out wait for the next one."""

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
