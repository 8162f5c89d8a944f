"""Waiting on many requests' outcomes from one event loop: a single watcher per client reads every
awaited key in one query per look, on one connection, however many handles wait.

The outcome row is the truth and a look is a plain read of it: nothing has to be published for a waiter
to see it, so an outcome written by any worker, a batch server or the beat sweep resolves its handles
alike. A new key brings the next look within ``FIRST`` seconds; while looks find nothing the pace
slows to ``SLOWEST``. Timeouts and cancellation remove a waiter at once; the watcher stops when nobody
waits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress

from reservations.requests import MAX_KEYS_PER_READ, RequestResult

log = logging.getLogger("tasks.outcomes")

Read = Callable[[Sequence[str]], Awaitable[dict[str, RequestResult]]]


class OutcomeTimeout(TimeoutError):
    def __init__(self, key: str, timeout: float) -> None:
        self.key = key
        super().__init__(f"no final outcome for {key!r} within {timeout}s")


class WatcherClosed(RuntimeError):
    """The client was closed while a handle still waited for its outcome."""


class OutcomeWatcher:
    FIRST = 0.005
    SLOWEST = 0.1

    def __init__(self, read: Read) -> None:
        self._read = read
        self._waiting: dict[str, list[asyncio.Future[RequestResult]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._news: asyncio.Event | None = None
        self._closed = False

    @property
    def waiting(self) -> int:
        """Keys with at least one waiter."""
        return len(self._waiting)

    async def wait(self, key: str, timeout: float) -> RequestResult:
        if self._closed:
            raise WatcherClosed("the client is closed")
        future: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, []).append(future)
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

    def _start(self) -> None:
        if self._news is None:
            self._news = asyncio.Event()
        self._news.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="outcome-watcher")

    async def _watch(self) -> None:
        assert self._news is not None
        pause = self.FIRST
        while self._waiting:
            if self._news.is_set():
                # Keys keep arriving in a burst: gather them for one look instead of a look each.
                self._news.clear()
                pause = self.FIRST
                await asyncio.sleep(self.FIRST)
            found = await self._look(list(self._waiting))
            pause = self.FIRST if found else min(pause * 1.5, self.SLOWEST)
            with suppress(TimeoutError):
                await asyncio.wait_for(self._news.wait(), pause)

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
