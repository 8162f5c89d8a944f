"""The async client's publishing thread: event loops queue requests, one thread records and publishes them in
batches.

Recording and publishing are blocking I/O. An event loop only appends a request to the outbox and awaits
a future; one thread takes what is queued, batch after batch, records the batch's requests in one
statement (tasks.producer: the database holds every request before the broker carries it), then publishes
each on one pooled producer (one broker connection), and settles each sender's future in its own loop.
Requests enqueued while a batch is going out wait for the next one.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass

from kombu.exceptions import OperationalError

from reservations.acceptance import Request
from tasks.errors import BrokerUnavailable, ClientClosed
from tasks.outcomes import copied
from tasks.producer import Sender


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A request queued for the publishing thread, whether it is recorded already (the front door records
    it as it admits it), and where to tell its sender the task id."""

    request: Request
    recorded: bool
    future: asyncio.Future[str]
    loop: asyncio.AbstractEventLoop


class Outbox:
    """The requests queued by event loops for ``sender``, and the one thread that records and publishes
    them."""

    def __init__(self, sender: Sender) -> None:
        self._sender = sender
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="enqueue")
        self._queued: list[Outgoing] = []
        self._lock = threading.Lock()
        self._draining = False
        self._closed = False

    async def publish(self, request: Request, *, recorded: bool = False) -> str:
        """Queue ``request``, starting the publishing thread if it is idle, and await its record and
        publication; returns its task id."""
        loop = asyncio.get_running_loop()
        sent: asyncio.Future[str] = loop.create_future()
        with self._lock:
            if self._closed:
                raise ClientClosed("the client is closed")
            self._queued.append(Outgoing(request, recorded, sent, loop))
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
            answers: list[tuple[Outgoing, str | None, BaseException | None]] = []
            try:
                self._sender.record([item.request for item in batch if not item.recorded])
            except Exception as exc:  # nothing of the batch is published unrecorded
                answers.extend((item, None, copied(exc)) for item in batch)
                batch = []
            try:
                with self._sender.producer.batch() as producer:
                    for item in batch:
                        try:
                            sent = self._sender.producer.publish(item.request, batch=producer)
                            answers.append((item, sent, None))
                        except OperationalError:
                            raise
                        except Exception as exc:  # this message only (it could not be encoded)
                            answers.append((item, None, exc))
            except Exception as exc:
                # No broker connection, after the publish retries of one message (about 0.6 s): the rest
                # of the batch would wait as long each, so its senders hear of it now, each with an
                # error of its own (a sender's raise adds to the error's traceback). Their requests are
                # recorded: the relay publishes them once the broker answers.
                answers.extend(
                    (item, None, BrokerUnavailable.of(exc) if isinstance(exc, OperationalError) else exc)
                    for item in batch[len(answers) :]
                )
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

