"""Lease managers: the blocking and the asyncio shell, both made from one set of plans (:class:`_Shell`).

``from_url`` picks the backend from the URL's scheme (:func:`lease_backend`): Redis in any of its
topologies (:class:`fencing.redis_executor.RedisTopology`), etcd, or SQL for a database URL. Written per
shell are only its executors, the schema, :meth:`hold` with its renewal (a :class:`Renewer` thread, or a
task) and closing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from typing import Any, ClassVar, Generic, Self, TypeAlias, TypeVar

from fencing.engines import make_async_engine, make_engine
from fencing.errors import BackendUnavailable, FencingError, InvalidLeaseRequest, LeaseBusy, StaleToken
from fencing.etcd_backend import EtcdLeaseCore
from fencing.etcd_gateway import ETCD_SCHEMES, AsyncEtcdExecutor, EtcdTarget, SyncEtcdExecutor, etcd_target
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
from fencing.plan import Atomic, Plan, Sleep, operation
from fencing.redis_backend import DEFAULT_PREFIX, RedisLeaseCore, validate_prefix
from fencing.redis_executor import (
    REDIS_SCHEMES,
    AsyncRedisExecutor,
    RedisTopology,
    SyncRedisExecutor,
    redis_client,
    redis_topology,
)
from fencing.sql import AsyncSqlExecutor, SyncSqlExecutor
from fencing.sql_backend import SqlLeaseCore, metadata
from fencing.urls import mask_url, normalize_url

log = logging.getLogger("fencing")

# Redis keeps each scope's last DEFAULT_HISTORY_CAP epochs (a short list, about 140 bytes an entry, that
# expires once the scope is idle for the retention): with its counter about 750 bytes a scope, whatever
# its age. The SQL backend keeps events until purge_history removes those older than the retention. The
# durable record of every token is the protected resource's own: each accepted write and each refused
# stale write carries its token and holder.
DEFAULT_HISTORY_CAP = 4
MAX_HISTORY_CAP = 100_000
DEFAULT_HISTORY_RETENTION = 30 * 24 * 3600.0
MAX_HISTORY_LIMIT = 10_000
# Scopes read in one current_many: one pipeline or one statement each (a list of keys that size stays a
# few hundred kilobytes).
MAX_SCOPES_READ = 1_000


# What each backend provides: one plan per operation, decisions and parsing only. An acquire returns the
# refusal of a busy scope rather than raising it, so that the mark it leaves on the live lease (contended)
# is kept; a release returns whether the lease was contended.
LeaseCore: TypeAlias = RedisLeaseCore | SqlLeaseCore | EtcdLeaseCore
# Where a lease URL points: etcd's members, a Redis topology, or a database URL.
Target: TypeAlias = EtcdTarget | RedisTopology | str


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


_RETENTION_MS = round(DEFAULT_HISTORY_RETENTION * 1000)

E = TypeVar("E")  # the shell's executor


def lease_backend(url: object) -> str:
    """``"redis"``, ``"etcd"`` or ``"sql"``: the backend ``from_url`` builds for ``url``, checked without
    connecting, so a process can refuse a URL it cannot use before it says it is ready. InvalidLeaseRequest
    says why."""
    target = _target(url)
    return "etcd" if isinstance(target, EtcdTarget) else "sql" if isinstance(target, str) else "redis"


def _target(url: object) -> Target:
    """Where a lease URL points: etcd's members, a Redis topology, or the database URL itself;
    InvalidLeaseRequest for anything else."""
    if not isinstance(url, str) or not url:
        raise InvalidLeaseRequest(f"the lease URL must be a non-empty string, not {type(url).__name__}")
    scheme = url.partition("://")[0].lower()
    if scheme in ETCD_SCHEMES:
        return etcd_target(url)
    if scheme in REDIS_SCHEMES:
        return redis_topology(url)
    try:
        normalize_url(url)
    except InvalidLeaseRequest:
        raise InvalidLeaseRequest(
            f"unsupported lease URL {mask_url(url)}: use redis://, rediss://, unix://, redis+sentinel://, "
            "redis+cluster://, etcd://, etcds:// or a database URL (sqlite, postgresql)"
        ) from None
    return url


def _renew_interval(lease: Lease, renew_every: float | None) -> float:
    return renew_every if renew_every is not None else lease.ttl / 3


# A renewal the coordinator did not answer is asked again after this, while the lease has at least twice
# as long left on its local clock.
RETRY_UNANSWERED = 0.05


def retry_renewal(lease: Lease, error: Exception) -> float | None:
    """After a renewal of ``lease`` raised ``error``: the seconds until it is asked again or, when the lease
    cannot be assumed renewed, None with the lease marked lost. For the renewers of both shells (a thread
    for the sync one, a task for the async one).

    An unanswered renewal (:class:`BackendUnavailable`) may well have left the lease held: the answer, not
    the lease, went missing, so it is asked again while the lease has time left on its local clock for
    another try, and a coordinator stalled for less than the ttl costs no lease. Any other failure, or too
    little time, and the lease is lost."""
    if isinstance(error, BackendUnavailable) and lease.time_left() > 2 * RETRY_UNANSWERED:
        return RETRY_UNANSWERED
    lease.mark_lost(
        f"renewal failed: {error}" if isinstance(error, FencingError) else f"renewal failed: {error!r}"
    )
    return None


class Renewer:
    """One thread per lease manager renews every lease held through it when each is due, instead of a
    thread started and joined per hold (about half a millisecond of a reservation task). Renewals run
    one at a time; a failed one is asked again or marks its lease lost, as its verdict says. Rebuilt in
    a forked child, which inherits the state but not the thread.

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
                self._wakes_at = now + self.IDLE_NAP
                if self._held:
                    lease_id, (due, lease, every) = min(self._held.items(), key=lambda item: item[1][0])
                    if due <= now:
                        self._wakes_at = 0.0
                        self._held[lease_id] = (now + every, lease, every)
                        self._busy = lease_id
                        return lease_id, lease
                    self._wakes_at = due
                self._cond.wait(self._wakes_at - now)

    def _run(self) -> None:
        while (claimed := self._next()) is not None:
            lease_id, lease = claimed
            failed, retry_in = False, None
            try:
                self._renew(lease)
            except Exception as exc:
                failed, retry_in = True, retry_renewal(lease, exc)
            with self._cond:
                if failed and retry_in is None:
                    self._held.pop(lease_id, None)
                elif retry_in is not None and lease_id in self._held:
                    _, held, every = self._held[lease_id]
                    self._held[lease_id] = (time.monotonic() + retry_in, held, every)
                self._busy = None
                self._cond.notify_all()


class _Shell(Generic[E]):
    """What both lease managers hold (the plans, the executor that runs them, the masked URL) and every
    operation that only runs a plan."""

    awaits: ClassVar[bool] = False

    def __init__(self, core: LeaseCore, executor: E, *, clock: Clock = time.monotonic, url: str = "") -> None:
        self.core = core
        self.clock = clock
        self.rng = random.Random()
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
        sleep: Callable[[float], Any] | None = None,
        **client_options: Any,
    ) -> Self:
        """The manager for ``url`` (Redis or SQL, by the URL's scheme); ``sleep`` is the shell's own pause
        (``time.sleep``, ``asyncio.sleep``) by default, ``client_options`` go to the client or engine."""
        # The prefix and cap are checked on every backend, though only Redis and etcd use them: a bad
        # argument is a bug either way.
        validate_prefix(prefix)
        cap = history_cap
        if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= MAX_HISTORY_CAP:
            raise InvalidLeaseRequest(f"history_cap must be a whole number from 1 to {MAX_HISTORY_CAP}")
        target = _target(url)
        executor = cls.executor_for(target, sleep, client_options)
        core: LeaseCore
        if isinstance(target, EtcdTarget):
            core = EtcdLeaseCore(prefix=target.prefix or prefix, history_cap=history_cap, clock=clock)
        elif isinstance(target, str):
            core = SqlLeaseCore(dialect=executor.engine.dialect.name, clock=clock)
        else:
            cluster = target.kind == "cluster"
            core = RedisLeaseCore(prefix, history_cap, _RETENTION_MS, clock, cluster=cluster)
        return cls(core, executor, clock=clock, url=url)

    @classmethod
    def executor_for(
        cls, target: Target, sleep: Callable[[float], Any] | None, options: dict[str, Any]
    ) -> Any:
        """The shell's executor on a new Redis client for a topology, a new HTTP client for etcd's members,
        or a new engine for a database URL."""
        raise NotImplementedError

    @property
    def backend(self) -> str:
        return self.core.backend

    @operation
    def acquire(self, scope: str, *, ttl: float, holder: str | None = None, wait: float = 0) -> Plan[Lease]:
        """Take the scope's lease and a new fencing token; :class:`LeaseBusy` if held past ``wait``."""
        validate_scope(scope)
        ttl = validate_ttl(ttl)
        # By default ``host:pid``: enough for an operator to find the process that holds a lease.
        holder = validate_holder(f"{socket.gethostname()}:{os.getpid()}" if holder is None else holder)
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

    @operation
    def renew(self, lease: Lease) -> Plan[Lease]:
        """Extend the lease, keeping its token; :class:`LeaseLost` (sticky) if it is no longer held."""
        check_lease(lease).raise_if_lost()  # renewal never resurrects a lost lease
        renewed: Lease = yield Atomic(self.core.renew(lease))
        return renewed

    @operation
    def release(self, lease: Lease) -> Plan[None]:
        """End the lease by its id; :class:`LeaseLost` if it had already expired or been superseded."""
        contended: bool = yield Atomic(self.core.release(check_lease(lease)))
        lease._released(contended)
        # Authority ends with the release: a write issued after it is refused here, without a round trip.
        lease.mark_lost("released by its holder")

    @operation
    def current(self, scope: str) -> Plan[LeaseInfo | None]:
        found: list[LeaseInfo | None] = yield Atomic(self.core.current_many([validate_scope(scope)]))
        return found[0]

    @operation
    def current_many(self, scopes: Sequence[str]) -> Plan[dict[str, LeaseInfo]]:
        """The live leases of up to MAX_SCOPES_READ scopes, by scope, in one round trip (one pipeline, one
        statement; a Cluster is asked scope by scope); a scope without one is left out."""
        checked = [validate_scope(scope) for scope in scopes]
        if not 1 <= len(checked) <= MAX_SCOPES_READ:
            raise InvalidLeaseRequest(f"read the leases of 1 to {MAX_SCOPES_READ} scopes at a time")
        found: list[LeaseInfo | None] = yield Atomic(self.core.current_many(checked))
        return {info.scope: info for info in found if info is not None}

    @operation
    def history(self, scope: str, *, limit: int = 100) -> Plan[list[LeaseEvent]]:
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_HISTORY_LIMIT:
            raise InvalidLeaseRequest(f"limit must be between 1 and {MAX_HISTORY_LIMIT}")
        events: list[LeaseEvent] = yield Atomic(self.core.history(validate_scope(scope), limit))
        return events

    @operation
    def purge_history(self, *, older_than: float = DEFAULT_HISTORY_RETENTION) -> Plan[int]:
        """Delete SQL lease events older than ``older_than`` seconds; Redis histories expire instead."""
        purged: int = yield Atomic(self.core.purge_history(round(validate_retention(older_than) * 1000)))
        return purged

    @operation
    def break_lease(self, scope: str, *, reason: str) -> Plan[LeaseInfo | None]:
        """Administrative: end the scope's current lease now. Its holder's next write is rejected."""
        validate_reason(reason)
        info: LeaseInfo | None = yield Atomic(self.core.break_lease(validate_scope(scope), reason))
        if info is not None:
            said = dict(
                event="lease_broken", scope=scope, token=info.token, holder=info.holder, reason=reason
            )
            log.warning(
                "lease on %(scope)r (token %(token)d, holder %(holder)r) broken: %(reason)s", said, extra=said
            )
        return info

    @operation
    def raise_base(self, highest: int) -> Plan[int | None]:
        """etcd: make every later token exceed ``highest`` (the protected resource's highest token) by
        raising the store's base, which only rises: at a worker's start, so a store first used, or restored
        from a snapshot, is never behind the stock rows. The base after; None on Redis and SQL, whose
        counters are per scope and repaired one by one (:meth:`handle_stale`)."""
        validate_token(highest)
        if not isinstance(self.core, EtcdLeaseCore):
            return None
        base: int = yield Atomic(self.core.raise_base(highest))
        return base

    @operation
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
        said = {
            "event": "token_regression_repaired",
            "scope": lease.scope,
            "token": lease.token,
            "highest": error.highest,
            "holder": lease.holder,
            "lease_id": lease.lease_id,
            "counter_from": old,
            "counter_to": new,
        }
        log.warning(
            "fencing token regression on scope %(scope)r: the coordinator had issued %(token)d but the "
            "resource has accepted %(highest)d; counter raised from %(counter_from)d to %(counter_to)d",
            said,
            extra=said,
        )
        return True


class LeaseManager(_Shell[SyncRedisExecutor | SyncSqlExecutor | SyncEtcdExecutor]):
    """Acquire, renew, release and inspect leases (blocking API, for Celery workers and scripts)."""

    def __init__(
        self,
        core: LeaseCore,
        executor: SyncRedisExecutor | SyncSqlExecutor | SyncEtcdExecutor,
        *,
        clock: Clock = time.monotonic,
        url: str = "",
    ) -> None:
        super().__init__(core, executor, clock=clock, url=url)
        self._renewer = Renewer(self.renew)

    @classmethod
    def executor_for(
        cls, target: Target, sleep: Callable[[float], Any] | None, options: dict[str, Any]
    ) -> SyncRedisExecutor | SyncSqlExecutor | SyncEtcdExecutor:
        if isinstance(target, str):
            return SyncSqlExecutor(make_engine(target, **options), sleep or time.sleep)
        if isinstance(target, EtcdTarget):
            return SyncEtcdExecutor(target, sleep or time.sleep, **options)
        return SyncRedisExecutor(redis_client(target, options), sleep or time.sleep)

    def create_schema(self) -> None:
        """Create the SQL backend's tables if missing (applications normally use migrations)."""
        if isinstance(self.executor, SyncSqlExecutor):
            metadata.create_all(self.executor.engine, checkfirst=True)

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
        """Hold the lease for the block, renewed by this manager's background renewer thread. A failed
        renewal is asked again or marks the lease lost, as :func:`retry_renewal` decides; once lost, the
        next guarded write raises without a round trip. A :class:`StaleToken` leaving the block triggers
        the regression repair check."""
        validate_renew_every(renew_every)
        lease = self.acquire(scope, ttl=ttl, holder=holder, wait=wait)
        self._renewer.add(lease, _renew_interval(lease, renew_every))
        try:
            yield lease
        except StaleToken as exc:
            self._renewer.remove(lease)
            with _logged(lease):
                self.handle_stale(lease, exc)
            raise
        finally:
            self._renewer.remove(lease)
            if not lease.lost:
                with _logged(lease):
                    self.release(lease)

    def close(self) -> None:
        self._renewer.close()
        self.executor.close()

    def __enter__(self) -> LeaseManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncLeaseManager(_Shell[AsyncRedisExecutor | AsyncSqlExecutor | AsyncEtcdExecutor]):
    """The asyncio shell: same plans, awaited I/O, renewal in a task instead of a thread."""

    awaits = True

    @classmethod
    def executor_for(
        cls, target: Target, sleep: Callable[[float], Any] | None, options: dict[str, Any]
    ) -> AsyncRedisExecutor | AsyncSqlExecutor | AsyncEtcdExecutor:
        if isinstance(target, str):
            return AsyncSqlExecutor(make_async_engine(target, **options), sleep or asyncio.sleep)
        if isinstance(target, EtcdTarget):
            return AsyncEtcdExecutor(target, sleep or asyncio.sleep, **options)
        return AsyncRedisExecutor(redis_client(target, options, asynchronous=True), sleep or asyncio.sleep)

    async def create_schema(self) -> None:
        """Create the SQL backend's tables if missing (applications normally use migrations)."""
        if isinstance(self.executor, AsyncSqlExecutor):
            async with self.executor.engine.begin() as conn:
                await conn.run_sync(metadata.create_all, checkfirst=True)

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
        """As :meth:`LeaseManager.hold`, renewed by a task on this event loop instead of a thread."""
        validate_renew_every(renew_every)
        lease = await self.acquire(scope, ttl=ttl, holder=holder, wait=wait)

        async def renew_loop() -> None:
            me = asyncio.current_task()
            wait: float | None = _renew_interval(lease, renew_every)
            while wait is not None:
                await asyncio.sleep(wait)
                try:
                    await self.renew(lease)
                    wait = _renew_interval(lease, renew_every)
                except Exception as exc:
                    wait = None if me is not None and me.cancelling() else retry_renewal(lease, exc)
                # The hold ended while a renewal was in flight, and the client turned the cancel into an
                # answer or an error (a connection it drops): the cancel still stands, so stop here (the
                # hold releases the lease) rather than renew on under a hold that waits for this task.
                if me is not None and me.cancelling():
                    return

        renewer = asyncio.create_task(renew_loop(), name=f"renew:{scope}")
        try:
            yield lease
        except StaleToken as exc:
            await _cancel(renewer)
            with _logged(lease):
                await self.handle_stale(lease, exc)
            raise
        finally:
            await _cancel(renewer)
            if not lease.lost:
                with _logged(lease):
                    await self.release(lease)

    async def close(self) -> None:
        await self.executor.close()

    async def __aenter__(self) -> AsyncLeaseManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


@contextmanager
def _logged(lease: Lease) -> Iterator[None]:
    """A fencing error of the block (the release or repair on the way out of a hold) is logged, not raised:
    the block's own outcome is what the holder hears."""
    try:
        yield
    except FencingError as exc:
        log.info("lease on %r: %s", lease.scope, exc)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task
