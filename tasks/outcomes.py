"""Waiting on many requests' outcomes from one event loop: a single watcher per client reads every
awaited key in one query per look, on one connection, however many handles wait.

The outcome row is the truth and a look is a plain read of it: nothing has to be published for a waiter
to see it, so an outcome written by any worker, a batch server or the beat sweep resolves its handles
alike. A new key brings the next look within ``FIRST`` seconds; while looks find nothing the pace
slows to ``SLOWEST``. Timeouts and cancellation remove a waiter at once; the watcher stops when nobody
waits.

A broker failover can lose the messages of requests (queued, or held by a worker, and not yet copied to
the replica that takes over): those would never get an outcome. So a waiter whose client published the
request passes what it published, and after each look the watcher hands the requests still without an
outcome that :func:`republish_due` finds due to ``republish``, which publishes each again under the same
key (same task id, same arguments). A copy of a request that was not lost after all is harmless: the
idempotency key makes its second delivery return the stored outcome.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from reservations.requests import MAX_KEYS_PER_READ, RequestResult
from tasks.errors import OutcomeTimeout, WatcherClosed

log = logging.getLogger("tasks.outcomes")

Read = Callable[[Sequence[str]], Awaitable[dict[str, RequestResult]]]


@dataclass(frozen=True, slots=True)
class Published:
    """What a client published for a key, enough to publish it again: the task's operation and
    arguments, when (``at`` on the monotonic clock) and ``enqueued_at`` (seconds since the epoch, which a
    copy carries on, so the workers' enqueue-to-outcome latency counts the time lost), and its
    ``deadline`` (seconds since the epoch, or None), which a copy carries too: a copy is the same request.
    """

    name: str
    kwargs: Mapping[str, Any]
    at: float
    enqueued_at: float
    deadline: float | None = None


def republish_due(
    published_at: float, last_republished: float | None, now: float, outcome_seen: bool, after: float
) -> bool:
    """Whether a request published at ``published_at`` and published again last at ``last_republished``
    (None: never) is to be published again at ``now``: never once its outcome is seen, nor with ``after``
    0; first ``after`` seconds after its publication, then each time after twice the wait before (at
    ``after``, 2x, 4x, 8x... from the publication). A lost request is sent again within one bound of the
    failover that lost it, while a request that is only slow (a long queue) gets a copy only now and then,
    however long it is awaited, instead of a copy every ``after`` that would lengthen the queue further."""
    if outcome_seen or after <= 0:
        return False
    if last_republished is None:
        return now - published_at >= after
    return now - last_republished >= max(after, last_republished - published_at)


@dataclass(slots=True)
class _Sent:
    published: Published
    last: float | None = None


class OutcomeWatcher:
    """``republish(key, published)``: publish a request again, called from the event loop (it must not
    block) for each awaited request :func:`republish_due` finds due with ``republish_after``."""

    FIRST = 0.005
    SLOWEST = 0.1
    # A look at every waiting key is followed by a pause of at least this many times its own length: with
    # thousands waiting, a look costs the event loop milliseconds, and looks back to back (a key arriving
    # every few milliseconds asks for the next) would leave the loop nothing else. Keys that arrived since
    # the last look are looked at on their own in between, so a new request still hears within FIRST.
    SPACING = 3.0

    def __init__(
        self,
        read: Read,
        *,
        republish: Callable[[str, Published], None] | None = None,
        republish_after: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._republish = republish
        self._republish_after = republish_after
        self._clock = clock
        self._waiting: dict[str, list[asyncio.Future[RequestResult]]] = {}
        self._fresh: set[str] = set()  # keys that arrived since the last look
        self._sent: dict[str, _Sent] = {}
        self._task: asyncio.Task[None] | None = None
        self._news: asyncio.Event | None = None
        self._closed = False

    @property
    def waiting(self) -> int:
        """Keys with at least one waiter."""
        return len(self._waiting)

    async def wait(self, key: str, timeout: float, *, published: Published | None = None) -> RequestResult:
        """The key's outcome; ``published``: what this waiter's client published for it, to be published
        again while it has no outcome (None: the watcher never publishes it)."""
        if self._closed:
            raise WatcherClosed("the client is closed")
        future: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, []).append(future)
        self._fresh.add(key)
        if published is not None:
            self._sent.setdefault(key, _Sent(published))
        self._start()
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise OutcomeTimeout(key, timeout) from None
        finally:
            self._forget(key, future)

    def _forget(self, key: str, future: asyncio.Future[RequestResult]) -> None:
        waiters = self._waiting.get(key)
        if waiters is None:
            return
        with suppress(ValueError):
            waiters.remove(future)
        if not waiters:
            del self._waiting[key]
            self._sent.pop(key, None)  # nobody waits for it any more: nobody republishes it either

    def _start(self) -> None:
        if self._news is None:
            self._news = asyncio.Event()
        self._news.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="outcome-watcher")

    async def _watch(self) -> None:
        assert self._news is not None
        pause = self.FIRST  # FIRST after a look that found outcomes or after new keys, growing otherwise
        # Paced on the event loop's clock, as its sleeps are (the injected clock times republishing).
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
        """Read the keys' outcomes and hand each to its waiters, then publish again those due; returns
        how many were resolved."""
        resolved = 0
        seen: set[str] = set()
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
            seen.update(found)
            for key, result in found.items():
                resolved += self._settle(key, result=result)
        self._publish_again(keys, seen)
        return resolved

    def _publish_again(self, looked: list[str], seen: set[str]) -> None:
        """Hand each request of this look that is due to ``republish``, then count its wait from now."""
        if self._republish is None:
            return
        now = self._clock()
        for key in looked:
            sent = self._sent.get(key)
            if sent is None:
                continue
            if republish_due(sent.published.at, sent.last, now, key in seen, self._republish_after):
                sent.last = now
                try:
                    self._republish(key, sent.published)
                except Exception as exc:  # the watcher goes on; the next due time tries again
                    log.warning("could not publish %s again: %s", key, exc)

    def _settle(
        self, key: str, *, result: RequestResult | None = None, error: BaseException | None = None
    ) -> int:
        settled = 0
        self._sent.pop(key, None)
        for future in self._waiting.pop(key, []):
            if future.done():
                continue
            if error is not None:
                # A copy each: one instance raised in many tasks would collect all their tracebacks.
                future.set_exception(_copied(error))
            elif result is not None:
                future.set_result(result)
            settled += 1
        return settled

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


def _copied(error: BaseException) -> BaseException:
    """The same error as a new instance (same type, arguments and attributes), caused by the original."""
    kind = type(error)
    copied = kind.__new__(kind)
    copied.args = error.args
    copied.__dict__.update(vars(error))
    copied.__cause__ = error
    return copied
