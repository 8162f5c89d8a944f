"""Waiting on many requests' outcomes from one event loop: a single watcher per client reads every
awaited key in one query per look, on one connection, however many handles wait.

The outcome row is the truth and a look is a plain read of it: nothing has to be published for a waiter
to see it, so an outcome written by any worker, a batch server or the beat sweep resolves its handles
alike. A new key brings the next look within ``FIRST`` seconds; while looks find nothing the pace
slows to ``SLOWEST``. Timeouts and cancellation remove a waiter at once; the watcher stops when nobody
waits.

Nothing here publishes: a request whose message was lost (a broker failover, a worker killed after it
fetched it) is published again by the relay from its record (tasks.relay), whether or not anyone waits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress

from reservations.request_outcomes import MAX_KEYS_PER_READ, RequestResult
from tasks.errors import OutcomeTimeout, WatcherClosed

log = logging.getLogger("tasks.outcomes")

Read = Callable[[Sequence[str]], Awaitable[dict[str, RequestResult]]]


class OutcomeWatcher:
    """Reads the outcomes of every key awaited in one event loop (module docstring)."""

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
            for key, result in found.items():
                resolved += self._settle(key, result=result)
        return resolved

    def _settle(
        self, key: str, *, result: RequestResult | None = None, error: BaseException | None = None
    ) -> int:
        settled = 0
        for future in self._waiting.pop(key, []):
            if future.done():
                continue
            if error is not None:
                # A copy each: one instance raised in many tasks would collect all their tracebacks.
                future.set_exception(copied(error))
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


def copied(error: BaseException) -> BaseException:
    """The same error as a new instance (same type, arguments and attributes), caused by the original."""
    kind = type(error)
    copied = kind.__new__(kind)
    copied.args = error.args
    copied.__dict__.update(vars(error))
    copied.__cause__ = error
    return copied
