"""The outcome watcher: every key awaited in one event loop read in one query per look, and the futures of
its waiters settled from the loop (or, for the publishing thread's answers, from another thread)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from typing import TypeVar, cast

from reservations.request_outcomes import MAX_KEYS_PER_READ, RequestResult
from tasks.errors import OutcomeTimeout, WatcherClosed

log = logging.getLogger("tasks.client")
T = TypeVar("T")
# Futures settled in one turn of their event loop at most: the waiters of a whole batch woken in one turn
# would run their handlers back to back, and a request answered meanwhile (a health check) would wait for
# all of them.
SETTLED_PER_TURN = 8


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
        return sum(settle(future, result, None if error is None else copied(error)) for future in waiters)

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


def settle(future: asyncio.Future[T], result: T | None, error: BaseException | None) -> bool:
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
