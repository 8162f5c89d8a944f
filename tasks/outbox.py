"""The async client's publishing thread: event loops queue messages, one thread publishes them in batches.

Publishing is blocking kombu I/O. An event loop only appends a message to the outbox and awaits a future;
one thread sends what is queued, batch after batch, each batch on one pooled producer (one broker
connection), and settles each sender's future in its own loop. Requests enqueued while a batch is going
out wait for the next one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from kombu.exceptions import OperationalError

from tasks.errors import BrokerUnavailable, ClientClosed
from tasks.outcomes import Published
from tasks.producer import Producer

log = logging.getLogger("tasks.client")


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A message queued for the publishing thread, and where to tell its sender the task id."""

    name: str
    key: str
    kwargs: dict[str, Any]
    future: asyncio.Future[str]
    loop: asyncio.AbstractEventLoop
    enqueued_at: float | None = None  # a copy's: when its request was first enqueued
    deadline: float | None = None


def republished(key: str, since: float, error: BaseException | None) -> None:
    """Say how publishing a request again went; its error is nobody's to raise (the wait goes on, and
    the next due time tries again)."""
    if error is not None:
        log.warning("could not publish %s again after %.1fs without an outcome: %s", key, since, error)
    else:
        log.warning("published %s again: no outcome %.1fs after it was published", key, since)


class Outbox:
    """The messages queued by event loops for ``producer``, and the one thread that publishes them."""

    def __init__(self, producer: Producer) -> None:
        self._producer = producer
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="enqueue")
        self._queued: list[Outgoing] = []
        self._lock = threading.Lock()
        self._draining = False
        self._closed = False

    async def publish(self, name: str, key: str, kwargs: dict[str, Any], deadline: float | None) -> str:
        """Queue the message and await its publication; returns its task id."""
        loop = asyncio.get_running_loop()
        sent: asyncio.Future[str] = loop.create_future()
        self._queue(Outgoing(name, key, kwargs, sent, loop, deadline=deadline))
        return await sent

    def republish(self, key: str, published: Published, since: float) -> None:
        """Queue ``published`` again, same key, task id and arguments, without awaiting it: how it went is
        logged (:func:`republished`). Called in an event loop."""
        loop = asyncio.get_running_loop()
        sent: asyncio.Future[str] = loop.create_future()
        sent.add_done_callback(
            lambda done: republished(key, since, None if done.cancelled() else done.exception())
        )
        self._queue(
            Outgoing(
                published.name,
                key,
                dict(published.kwargs),
                sent,
                loop,
                published.enqueued_at,
                published.deadline,
            )
        )

    def _queue(self, item: Outgoing) -> None:
        """Append ``item`` to the outbox, starting the publishing thread if it is idle."""
        with self._lock:
            if self._closed:
                raise ClientClosed("the client is closed")
            self._queued.append(item)
            start, self._draining = not self._draining, True
            if start:
                # Under the lock: close() cannot shut the thread down between the check and this.
                item.loop.run_in_executor(self._publisher, self._drain)

    def _drain(self) -> None:
        """The publishing thread: send what is queued, batch after batch, until the outbox is empty."""
        while True:
            with self._lock:
                batch, self._queued = self._queued, []
                if not batch:
                    self._draining = False
                    return
            answers: list[tuple[Outgoing, str | None, BaseException | None]] = []
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
                answers.extend((item, None, _unsent(exc)) for item in batch[len(answers) :])
            for item, answer, error in answers:
                with suppress(RuntimeError):  # its loop closed meanwhile: nobody awaits it any more
                    item.loop.call_soon_threadsafe(_settle, item.future, answer, error)

    def close(self) -> None:
        """Publish nothing more: messages still queued are refused with ``ClientClosed``, later ones too."""
        with self._lock:
            self._closed = True
            left, self._queued = self._queued, []
        closed = ClientClosed("the client was closed before this request was published")
        for item in left:
            with suppress(RuntimeError):  # its loop closed meanwhile: nobody awaits it any more
                item.loop.call_soon_threadsafe(_settle, item.future, None, closed)
        self._publisher.shutdown(wait=False)


def _settle(future: asyncio.Future[str], sent: str | None, error: BaseException | None) -> None:
    if future.done():  # its sender was cancelled; the message went out all the same
        return
    if error is not None:
        future.set_exception(error)
    elif sent is not None:
        future.set_result(sent)
    else:  # pragma: no cover - the publisher answers a message id or an error
        future.set_exception(RuntimeError("the message was neither sent nor refused"))


def _unsent(error: Exception) -> Exception:
    """The error of a message left unsent because its batch found no broker connection: its own
    :class:`BrokerUnavailable` for each sender."""
    return BrokerUnavailable.of(error) if isinstance(error, OperationalError) else error
