"""Lease managers: the public sync and async shells over one set of plans.

``LeaseManager.from_url`` / ``AsyncLeaseManager.from_url`` pick the backend from the URL (``redis://``,
``rediss://`` or any SQLAlchemy URL). Validation, waiting, backoff and repair decisions live in
:class:`LeasePlans`; the shells only drive them and run the background renewal of :meth:`hold`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from typing import Any, Protocol

import redis
import redis.asyncio

from fencing.errors import FencingError, InvalidLeaseRequest, LeaseBusy, StaleToken
from fencing.keys import DEFAULT_PREFIX, validate_prefix
from fencing.lease import (
    Clock,
    Lease,
    LeaseEvent,
    LeaseInfo,
    check_lease,
    new_lease_id,
    validate_holder,
    validate_reason,
    validate_renew_every,
    validate_retention,
    validate_scope,
    validate_token,
    validate_ttl,
)
from fencing.plan import Atomic, Plan, Sleep
from fencing.redis_backend import AsyncRedisExecutor, RedisLeaseCore, SyncRedisExecutor
from fencing.sql import AsyncSqlExecutor, SyncSqlExecutor, make_async_engine, make_engine, mask_url
from fencing.sql_backend import SqlLeaseCore, metadata

log = logging.getLogger("fencing")

# Redis keeps each scope's last DEFAULT_HISTORY_CAP epochs (a short list, about 140 bytes an entry, that
# expires once the scope is idle for the retention): with its counter about 750 bytes a scope, whatever
# its age. The SQL backend keeps events until purge_history removes those older than the retention. The
# durable record of every token is the protected resource's own: each accepted write and each refused
# stale write carries its token and holder.
DEFAULT_HISTORY_CAP = 4
MAX_HISTORY_CAP = 100_000
DEFAULT_HISTORY_RETENTION = 30 * 24 * 3600.0
_RETENTION_MS = round(DEFAULT_HISTORY_RETENTION * 1000)
MAX_HISTORY_LIMIT = 10_000


class LeaseCore(Protocol):
    backend: str

    def acquire(self, scope: str, ttl: float, holder: str, lease_id: str) -> Plan[Lease | LeaseBusy]:
        """A new lease, or (returned, not raised, so that the mark it leaves on the lease is kept) the
        refusal of a busy scope."""
        ...
    def renew(self, lease: Lease) -> Plan[Lease]: ...
    def release(self, lease: Lease) -> Plan[bool]:
        """End the lease; returns whether another acquirer found it busy while it was held."""
        ...
    def break_lease(self, scope: str, reason: str) -> Plan[LeaseInfo | None]: ...
    def repair(self, lease: Lease, highest: int) -> Plan[tuple[int, int] | None]: ...
    def current(self, scope: str) -> Plan[LeaseInfo | None]: ...
    def history(self, scope: str, limit: int) -> Plan[list[LeaseEvent]]: ...
    def purge_history(self, older_than_ms: int) -> Plan[int]: ...


def backoff(
    attempt: int,
    retry_after: float,
    rng: random.Random,
    *,
    first: float = 0.005,
    cap: float = 0.5,
    floor: float = 0.001,
) -> float:
    """Full-jitter exponential backoff, capped by the time the current lease has left.

    The holder usually releases long before its ttl runs out, so ``retry_after`` is a ceiling, not a wait.
    """
    ceiling = min(cap, first * 2 ** min(attempt, 30))
    return min(max(retry_after, floor), rng.uniform(floor, ceiling))


class LeasePlans:
    """Validation and decisions shared by both shells."""

    def __init__(self, core: LeaseCore, clock: Clock, rng: random.Random | None = None) -> None:
        self.core = core
        self.clock = clock
        self.rng = rng or random.Random()

    def acquire(self, scope: str, ttl: float, holder: str | None, wait: float) -> Plan[Lease]:
        validate_scope(scope)
        ttl = validate_ttl(ttl)
        holder = validate_holder(default_holder() if holder is None else holder)
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= 3600:
            raise InvalidLeaseRequest("wait must be between 0 and 3600 seconds")
        deadline = self.clock() + wait
        attempt = 0
        while True:
            got: Lease | LeaseBusy = yield Atomic(self.core.acquire(scope, ttl, holder, new_lease_id()))
            if isinstance(got, Lease):
                return got
            left = deadline - self.clock()
            if left <= 0:
                raise got
            yield Sleep(min(left, backoff(attempt, got.retry_after, self.rng)))
            attempt += 1

    def renew(self, lease: Lease) -> Plan[Lease]:
        check_lease(lease).raise_if_lost()  # renewal never resurrects a lost lease
        renewed: Lease = yield Atomic(self.core.renew(lease))
        return renewed

    def release(self, lease: Lease) -> Plan[None]:
        contended: bool = yield Atomic(self.core.release(check_lease(lease)))
        lease._released(contended)
        # Authority ends with the release: a write issued after it is refused here, without a round trip.
        lease.mark_lost("released by its holder")

    def current(self, scope: str) -> Plan[LeaseInfo | None]:
        info: LeaseInfo | None = yield Atomic(self.core.current(validate_scope(scope)))
        return info

    def history(self, scope: str, limit: int) -> Plan[list[LeaseEvent]]:
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_HISTORY_LIMIT:
            raise InvalidLeaseRequest(f"limit must be between 1 and {MAX_HISTORY_LIMIT}")
        events: list[LeaseEvent] = yield Atomic(self.core.history(validate_scope(scope), limit))
        return events

    def purge_history(self, older_than: float) -> Plan[int]:
        purged: int = yield Atomic(self.core.purge_history(round(validate_retention(older_than) * 1000)))
        return purged

    def break_lease(self, scope: str, reason: str) -> Plan[LeaseInfo | None]:
        validate_reason(reason)
        info: LeaseInfo | None = yield Atomic(self.core.break_lease(validate_scope(scope), reason))
        if info is not None:
            log.warning(
                "lease on %r (token %d, holder %r) broken: %s", scope, info.token, info.holder, reason
            )
        return info

    def handle_stale(self, lease: Lease, error: StaleToken) -> Plan[bool]:
        """Repair a coordinator whose counter went backwards; True if it did.

        Only a holder that is still current at the coordinator proves the coordinator is behind; any
        other stale rejection is an ordinary lost race and needs nothing. Either way the rejected
        attempt stays lost.
        """
        if not isinstance(error, StaleToken):
            raise InvalidLeaseRequest(f"expected a StaleToken, got {type(error).__name__}")
        if check_lease(lease).scope != error.scope or error.presented != lease.token:
            return False  # another lease's rejection says nothing about this one
        # Checked before anything changes: raising the counter past MAX_TOKEN would leave it unable to
        # issue another token, or overflow it.
        validate_token(error.highest, scope=lease.scope)
        lease.mark_lost(f"stale: resource accepted token {error.highest}")
        repaired = yield Atomic(self.core.repair(lease, error.highest))
        if repaired is None:
            return False
        old, new = repaired
        log.warning(
            "fencing token regression on scope %r: the coordinator had issued %d but the resource "
            "has accepted %d; counter raised from %d to %d",
            lease.scope,
            lease.token,
            error.highest,
            old,
            new,
        )
        return True


def default_holder() -> str:
    """``host:pid``: enough for an operator to find the process that holds a lease."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _is_redis_url(url: object) -> bool:
    if not isinstance(url, str) or not url:
        raise InvalidLeaseRequest(f"the lease URL must be a non-empty string, not {type(url).__name__}")
    return url.startswith(("redis://", "rediss://", "unix://"))


def _history_cap(cap: object) -> int:
    """How many events a Redis stream keeps per scope (the ``MAXLEN`` of every ``XADD``)."""
    if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= MAX_HISTORY_CAP:
        raise InvalidLeaseRequest(f"history_cap must be a whole number from 1 to {MAX_HISTORY_CAP}")
    return cap


def _redis_client(kind: Any, url: str, options: dict[str, Any]) -> Any:
    try:
        return kind.from_url(url, decode_responses=True, **options)
    except ValueError as exc:  # a malformed port, database number or option
        raise InvalidLeaseRequest(f"not a usable Redis URL: {mask_url(url)} ({exc})") from None


def _renew_interval(lease: Lease, renew_every: float | None) -> float:
    return renew_every if renew_every is not None else lease.ttl / 3


class _Renewer:
    """One thread per lease manager renews every lease held through it when each is due, instead of a
    thread started and joined per hold (about half a millisecond of a reservation task). Renewals run
    one at a time; a failed one marks its lease lost, as a lost lease must be known without a round
    trip. Rebuilt in a forked child, which inherits the state but not the thread.

    Adding a lease wakes the thread only when the lease is due before the thread's next wake-up: a
    worker adds and removes a lease per task, and a wake-up per task (a thread switch and the GIL
    changing hands twice) costs more than the rest of the bookkeeping. With nothing held the thread
    naps ``IDLE_NAP`` at a time, so a lease due later than that never needs to wake it."""

    IDLE_NAP = 1.0

    def __init__(self, renew: Callable[[Lease], Any]) -> None:
        self._renew = renew
        self._cond = threading.Condition()
        self._held: dict[str, tuple[float, Lease, float]] = {}  # lease id -> (due, lease, interval)
        self._busy: str | None = None  # the lease id being renewed right now
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._closed = False
        self._wakes_at = 0.0  # monotonic time the thread wakes by on its own (0: not waiting)

    def add(self, lease: Lease, every: float) -> None:
        with self._cond:
            if self._pid != os.getpid():
                self._held, self._busy, self._thread, self._pid = {}, None, None, os.getpid()
            self._closed = False
            due = time.monotonic() + every
            self._held[lease.lease_id] = (due, lease, every)
            if self._thread is None or not self._thread.is_alive():
                self._wakes_at = 0.0
                self._thread = threading.Thread(target=self._run, name="lease-renewer", daemon=True)
                self._thread.start()
            elif due < self._wakes_at:
                self._cond.notify_all()

    def remove(self, lease: Lease) -> None:
        """Stop renewing ``lease``; returns once no renewal of it is in flight, so a release or a repair
        that follows never races one."""
        with self._cond:
            self._held.pop(lease.lease_id, None)
            while self._busy == lease.lease_id:
                self._cond.wait()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _next(self) -> tuple[str, Lease] | None:
        """Wait until a lease is due and claim it; None when closed with nothing held."""
        with self._cond:
            while True:
                if self._closed and not self._held:
                    self._thread = None  # a hold added after this starts a thread of its own
                    return None
                now = time.monotonic()
                if not self._held:
                    self._wakes_at = now + self.IDLE_NAP
                    self._cond.wait(self.IDLE_NAP)
                    continue
                lease_id, (due, lease, every) = min(self._held.items(), key=lambda item: item[1][0])
                if due > now:
                    self._wakes_at = due
                    self._cond.wait(due - now)
                    continue
                self._wakes_at = 0.0
                self._held[lease_id] = (now + every, lease, every)
                self._busy = lease_id
                return lease_id, lease

    def _run(self) -> None:
        while (claimed := self._next()) is not None:
            lease_id, lease = claimed
            try:
                self._renew(lease)
                failed: str | None = None
            except FencingError as exc:
                failed = f"renewal failed: {exc}"
            except Exception as exc:  # whatever it was, the lease cannot be assumed renewed
                failed = f"renewal failed: {exc!r}"
            with self._cond:
                if failed is not None:
                    lease.mark_lost(failed)
                    self._held.pop(lease_id, None)
                self._busy = None
                self._cond.notify_all()


class LeaseManager:
    """Acquire, renew, release and inspect leases (blocking API, for Celery workers and scripts)."""

    def __init__(
        self,
        core: LeaseCore,
        executor: SyncRedisExecutor | SyncSqlExecutor,
        *,
        clock: Clock = time.monotonic,
        url: str = "",
    ) -> None:
        self.plans = LeasePlans(core, clock)
        self.executor = executor
        self.url = mask_url(url) if url else ""
        self._renewer = _Renewer(self.renew)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        history_cap: int = DEFAULT_HISTORY_CAP,
        clock: Clock = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        **client_options: Any,
    ) -> LeaseManager:
        core: LeaseCore
        executor: SyncRedisExecutor | SyncSqlExecutor
        # Checked on every backend, though only Redis uses them: a bad argument is a bug either way.
        prefix, history_cap = validate_prefix(prefix), _history_cap(history_cap)
        if _is_redis_url(url):
            client = _redis_client(redis.Redis, url, client_options)
            core = RedisLeaseCore(
                prefix=prefix, history_cap=history_cap, history_retention_ms=_RETENTION_MS, clock=clock
            )
            executor = SyncRedisExecutor(client, sleep)
        else:
            engine = make_engine(url, **client_options)
            core = SqlLeaseCore(dialect=engine.dialect.name, clock=clock)
            executor = SyncSqlExecutor(engine, sleep)
        return cls(core, executor, clock=clock, url=url)

    @property
    def backend(self) -> str:
        return self.plans.core.backend

    def create_schema(self) -> None:
        """Create the SQL backend's tables if missing (applications normally use migrations)."""
        if isinstance(self.executor, SyncSqlExecutor):
            metadata.create_all(self.executor.engine, checkfirst=True)

    def acquire(self, scope: str, *, ttl: float, holder: str | None = None, wait: float = 0) -> Lease:
        """Take the scope's lease and a new fencing token; :class:`LeaseBusy` if held past ``wait``."""
        return self.executor.run(self.plans.acquire(scope, ttl, holder, wait))  # type: ignore[no-any-return]

    def renew(self, lease: Lease) -> Lease:
        """Extend the lease, keeping its token; :class:`LeaseLost` (sticky) if it is no longer held."""
        return self.executor.run(self.plans.renew(lease))  # type: ignore[no-any-return]

    def release(self, lease: Lease) -> None:
        """End the lease by its id; :class:`LeaseLost` if it had already expired or been superseded."""
        self.executor.run(self.plans.release(lease))

    def current(self, scope: str) -> LeaseInfo | None:
        return self.executor.run(self.plans.current(scope))  # type: ignore[no-any-return]

    def history(self, scope: str, *, limit: int = 100) -> list[LeaseEvent]:
        return self.executor.run(self.plans.history(scope, limit))  # type: ignore[no-any-return]

    def purge_history(self, *, older_than: float = DEFAULT_HISTORY_RETENTION) -> int:
        """Delete SQL lease events older than ``older_than`` seconds; Redis streams are capped instead."""
        return self.executor.run(self.plans.purge_history(older_than))  # type: ignore[no-any-return]

    def break_lease(self, scope: str, *, reason: str) -> LeaseInfo | None:
        """Administrative: end the scope's current lease now. Its holder's next write is rejected."""
        return self.executor.run(self.plans.break_lease(scope, reason))  # type: ignore[no-any-return]

    def handle_stale(self, lease: Lease, error: StaleToken) -> bool:
        return self.executor.run(self.plans.handle_stale(lease, error))  # type: ignore[no-any-return]

    @contextmanager
    def hold(
        self,
        scope: str,
        *,
        ttl: float,
        holder: str | None = None,
        wait: float = 0,
        renew_every: float | None = None,
    ) -> Iterator[Lease]:
        """Hold the lease for the block, renewed by this manager's background renewer thread.

        The moment a renewal fails the lease is marked lost, so the next guarded write raises without a
        round trip. A :class:`StaleToken` leaving the block triggers the regression repair check.
        """
        validate_renew_every(renew_every)
        lease = self.acquire(scope, ttl=ttl, holder=holder, wait=wait)
        self._renewer.add(lease, _renew_interval(lease, renew_every))
        try:
            yield lease
        except StaleToken as exc:
            self._renewer.remove(lease)
            self._quietly(self.handle_stale, lease, exc)
            raise
        finally:
            self._renewer.remove(lease)
            if not lease.lost:
                self._quietly(self.release, lease)

    def _quietly(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except FencingError as exc:
            log.info("lease on %r: %s", args[0].scope, exc)

    def close(self) -> None:
        self._renewer.close()
        self.executor.close()

    def __enter__(self) -> LeaseManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncLeaseManager:
    """The asyncio shell: same plans, awaited I/O, renewal in a task instead of a thread."""

    def __init__(
        self,
        core: LeaseCore,
        executor: AsyncRedisExecutor | AsyncSqlExecutor,
        *,
        clock: Clock = time.monotonic,
        url: str = "",
    ) -> None:
        self.plans = LeasePlans(core, clock)
        self.executor = executor
        self.url = mask_url(url) if url else ""

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        history_cap: int = DEFAULT_HISTORY_CAP,
        clock: Clock = time.monotonic,
        sleep: Callable[[float], Any] = asyncio.sleep,
        **client_options: Any,
    ) -> AsyncLeaseManager:
        core: LeaseCore
        executor: AsyncRedisExecutor | AsyncSqlExecutor
        # Checked on every backend, though only Redis uses them: a bad argument is a bug either way.
        prefix, history_cap = validate_prefix(prefix), _history_cap(history_cap)
        if _is_redis_url(url):
            client = _redis_client(redis.asyncio.Redis, url, client_options)
            core = RedisLeaseCore(
                prefix=prefix, history_cap=history_cap, history_retention_ms=_RETENTION_MS, clock=clock
            )
            executor = AsyncRedisExecutor(client, sleep)
        else:
            engine = make_async_engine(url, **client_options)
            core = SqlLeaseCore(dialect=engine.dialect.name, clock=clock)
            executor = AsyncSqlExecutor(engine, sleep)
        return cls(core, executor, clock=clock, url=url)

    @property
    def backend(self) -> str:
        return self.plans.core.backend

    async def create_schema(self) -> None:
        if isinstance(self.executor, AsyncSqlExecutor):
            async with self.executor.engine.begin() as conn:
                await conn.run_sync(metadata.create_all, checkfirst=True)

    async def acquire(self, scope: str, *, ttl: float, holder: str | None = None, wait: float = 0) -> Lease:
        return await self.executor.run(self.plans.acquire(scope, ttl, holder, wait))  # type: ignore[no-any-return]

    async def renew(self, lease: Lease) -> Lease:
        return await self.executor.run(self.plans.renew(lease))  # type: ignore[no-any-return]

    async def release(self, lease: Lease) -> None:
        await self.executor.run(self.plans.release(lease))

    async def current(self, scope: str) -> LeaseInfo | None:
        return await self.executor.run(self.plans.current(scope))  # type: ignore[no-any-return]

    async def history(self, scope: str, *, limit: int = 100) -> list[LeaseEvent]:
        return await self.executor.run(self.plans.history(scope, limit))  # type: ignore[no-any-return]

    async def purge_history(self, *, older_than: float = DEFAULT_HISTORY_RETENTION) -> int:
        return await self.executor.run(self.plans.purge_history(older_than))  # type: ignore[no-any-return]

    async def break_lease(self, scope: str, *, reason: str) -> LeaseInfo | None:
        return await self.executor.run(self.plans.break_lease(scope, reason))  # type: ignore[no-any-return]

    async def handle_stale(self, lease: Lease, error: StaleToken) -> bool:
        return await self.executor.run(self.plans.handle_stale(lease, error))  # type: ignore[no-any-return]

    @asynccontextmanager
    async def hold(
        self,
        scope: str,
        *,
        ttl: float,
        holder: str | None = None,
        wait: float = 0,
        renew_every: float | None = None,
    ) -> AsyncIterator[Lease]:
        validate_renew_every(renew_every)
        lease = await self.acquire(scope, ttl=ttl, holder=holder, wait=wait)

        async def renew_loop() -> None:
            while True:
                await asyncio.sleep(_renew_interval(lease, renew_every))
                try:
                    await self.renew(lease)
                except FencingError as exc:
                    lease.mark_lost(f"renewal failed: {exc}")
                    return

        renewer = asyncio.create_task(renew_loop(), name=f"renew:{scope}")
        try:
            yield lease
        except StaleToken as exc:
            await _cancel(renewer)
            await self._quietly(self.handle_stale(lease, exc), lease)
            raise
        finally:
            await _cancel(renewer)
            if not lease.lost:
                await self._quietly(self.release(lease), lease)

    async def _quietly(self, call: Any, lease: Lease) -> None:
        try:
            await call
        except FencingError as exc:
            log.info("lease on %r: %s", lease.scope, exc)

    async def close(self) -> None:
        await self.executor.close()

    async def __aenter__(self) -> AsyncLeaseManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task
