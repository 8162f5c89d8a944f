"""Lease managers: the public sync and async shells, both made from one set of plans.

``LeaseManager.from_url`` / ``AsyncLeaseManager.from_url`` pick the backend from the URL: Redis for
``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://`` and ``redis+cluster://``
(:class:`fencing.redis_topology.RedisTopology` gives their forms), SQL for any SQLAlchemy URL.
Validation, waiting, backoff and repair decisions live in :mod:`fencing.lease_plans`. Each operation
(acquire, renew, release, the reads, the purge, the break, the repair) is written once in :class:`_Shell`,
as the plan it runs (:class:`fencing.shells.operation`): blocking in :class:`LeaseManager`, awaitable in
:class:`AsyncLeaseManager`; so is ``from_url``. Written per shell are only the executors it builds, the
schema, :meth:`hold` with its background renewal (a thread, :class:`fencing.renewer.Renewer`, or a task;
what follows a failed renewal is :func:`fencing.lease_plans.renewal_verdict` for both) and closing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from typing import Any, ClassVar, Generic, Self, TypeVar

from fencing.engines import make_async_engine, make_engine
from fencing.errors import FencingError, InvalidLeaseRequest, StaleToken
from fencing.keys import DEFAULT_PREFIX, validate_prefix
from fencing.lease import Clock, Lease, LeaseEvent, LeaseInfo, validate_renew_every
from fencing.lease_plans import (
    DEFAULT_HISTORY_CAP,
    DEFAULT_HISTORY_RETENTION,
    MAX_HISTORY_CAP,
    MAX_HISTORY_LIMIT,
    LeaseCore,
    LeasePlans,
    backoff,
    default_holder,
    renewal_verdict,
)
from fencing.plan import Plan
from fencing.redis_backend import RedisLeaseCore
from fencing.redis_executor import AsyncRedisExecutor, SyncRedisExecutor, async_client, sync_client
from fencing.redis_topology import REDIS_SCHEMES, RedisTopology, redis_topology
from fencing.renewer import Renewer
from fencing.shells import operation
from fencing.sql_backend import SqlLeaseCore, metadata
from fencing.sql_executor import AsyncSqlExecutor, SyncSqlExecutor
from fencing.urls import mask_url, normalize_url

# Re-exported: callers import these from here (the policy itself lives in fencing.lease_plans).
__all__ = [
    "DEFAULT_HISTORY_CAP",
    "DEFAULT_HISTORY_RETENTION",
    "MAX_HISTORY_CAP",
    "MAX_HISTORY_LIMIT",
    "AsyncLeaseManager",
    "LeaseCore",
    "LeaseManager",
    "LeasePlans",
    "backoff",
    "default_holder",
    "lease_backend",
]

log = logging.getLogger("fencing")

_RETENTION_MS = round(DEFAULT_HISTORY_RETENTION * 1000)

E = TypeVar("E")  # the shell's executor
C = TypeVar("C")  # a Redis client, or what builds one


def lease_backend(url: object) -> str:
    """``"redis"`` or ``"sql"``: the backend ``from_url`` builds for ``url``, checked without connecting,
    so a process can refuse a URL it cannot use before it says it is ready. InvalidLeaseRequest says why."""
    return "sql" if _redis_topology(url) is None else "redis"


def _redis_topology(url: object) -> RedisTopology | None:
    """Where a Redis lease URL puts the keys; None for a database URL; InvalidLeaseRequest for neither."""
    if not isinstance(url, str) or not url:
        raise InvalidLeaseRequest(f"the lease URL must be a non-empty string, not {type(url).__name__}")
    if url.partition("://")[0].lower() in REDIS_SCHEMES:
        return redis_topology(url)
    try:
        normalize_url(url)
    except InvalidLeaseRequest:
        raise InvalidLeaseRequest(
            f"unsupported lease URL {mask_url(url)}: use redis://, rediss://, unix://, redis+sentinel://, "
            "redis+cluster:// or a database URL (sqlite, postgresql)"
        ) from None
    return None


def _history_cap(cap: object) -> int:
    """How many epochs a Redis scope's history keeps."""
    if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= MAX_HISTORY_CAP:
        raise InvalidLeaseRequest(f"history_cap must be a whole number from 1 to {MAX_HISTORY_CAP}")
    return cap


def _redis_core(
    url: str, prefix: str, history_cap: int, clock: Clock
) -> tuple[RedisLeaseCore, RedisTopology] | None:
    """The Redis core and topology for a Redis URL, None for a database URL. The prefix and cap are
    checked on every backend, though only Redis uses them: a bad argument is a bug either way."""
    prefix, history_cap = validate_prefix(prefix), _history_cap(history_cap)
    topology = _redis_topology(url)
    if topology is None:
        return None
    core = RedisLeaseCore(
        prefix=prefix,
        history_cap=history_cap,
        history_retention_ms=_RETENTION_MS,
        clock=clock,
        cluster=topology.kind == "cluster",
    )
    return core, topology


def _redis_client(
    connect: Callable[[RedisTopology, dict[str, Any]], C], topology: RedisTopology, options: dict[str, Any]
) -> C:
    try:
        return connect(topology, options)
    except ValueError as exc:  # a malformed port, database number or option
        raise InvalidLeaseRequest(f"not a usable Redis URL: {topology.masked} ({exc})") from None


def _printable(url: str) -> str:
    """The URL as it may be printed: a Redis topology masks its own (Sentinel and Cluster URLs name several
    hosts), any other URL goes through mask_url."""
    try:
        topology = _redis_topology(url)
    except InvalidLeaseRequest:
        topology = None
    return mask_url(url) if topology is None else topology.masked


def _renew_interval(lease: Lease, renew_every: float | None) -> float:
    return renew_every if renew_every is not None else lease.ttl / 3


class _Shell(Generic[E]):
    """What both lease managers hold (the plans, the executor that runs them, the masked URL) and every
    operation that only runs a plan, written once: each is blocking in :class:`LeaseManager` and a
    coroutine function in :class:`AsyncLeaseManager` (``awaits``)."""

    awaits: ClassVar[bool] = False

    def __init__(self, core: LeaseCore, executor: E, *, clock: Clock = time.monotonic, url: str = "") -> None:
        self.plans = LeasePlans(core, clock)
        self.executor = executor
        self.url = _printable(url) if url else ""

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
        found = _redis_core(url, prefix, history_cap, clock)
        if found is not None:
            core, topology = found
            return cls(core, cls.redis_executor(topology, sleep, client_options), clock=clock, url=url)
        executor = cls.sql_executor(url, sleep, client_options)
        sql_core = SqlLeaseCore(dialect=executor.engine.dialect.name, clock=clock)
        return cls(sql_core, executor, clock=clock, url=url)

    @classmethod
    def redis_executor(
        cls, topology: RedisTopology, sleep: Callable[[float], Any] | None, options: dict[str, Any]
    ) -> E:
        """The shell's executor on a new Redis client for ``topology``."""
        raise NotImplementedError

    @classmethod
    def sql_executor(cls, url: str, sleep: Callable[[float], Any] | None, options: dict[str, Any]) -> Any:
        """The shell's executor on a new engine for ``url`` (an SQL executor: its engine names the
        dialect)."""
        raise NotImplementedError

    @property
    def backend(self) -> str:
        return self.plans.core.backend

    @operation
    def acquire(self, scope: str, *, ttl: float, holder: str | None = None, wait: float = 0) -> Plan[Lease]:
        """Take the scope's lease and a new fencing token; :class:`LeaseBusy` if held past ``wait``."""
        return self.plans.acquire(scope, ttl, holder, wait)

    @operation
    def renew(self, lease: Lease) -> Plan[Lease]:
        """Extend the lease, keeping its token; :class:`LeaseLost` (sticky) if it is no longer held."""
        return self.plans.renew(lease)

    @operation
    def release(self, lease: Lease) -> Plan[None]:
        """End the lease by its id; :class:`LeaseLost` if it had already expired or been superseded."""
        return self.plans.release(lease)

    @operation
    def current(self, scope: str) -> Plan[LeaseInfo | None]:
        return self.plans.current(scope)

    @operation
    def current_many(self, scopes: Sequence[str]) -> Plan[dict[str, LeaseInfo]]:
        """The live leases of up to MAX_SCOPES_READ scopes, by scope, in one round trip (one pipeline, one
        statement; a Cluster is asked scope by scope); a scope without one is left out."""
        return self.plans.current_many(scopes)

    @operation
    def history(self, scope: str, *, limit: int = 100) -> Plan[list[LeaseEvent]]:
        return self.plans.history(scope, limit)

    @operation
    def purge_history(self, *, older_than: float = DEFAULT_HISTORY_RETENTION) -> Plan[int]:
        """Delete SQL lease events older than ``older_than`` seconds; Redis histories expire instead."""
        return self.plans.purge_history(older_than)

    @operation
    def break_lease(self, scope: str, *, reason: str) -> Plan[LeaseInfo | None]:
        """Administrative: end the scope's current lease now. Its holder's next write is rejected."""
        return self.plans.break_lease(scope, reason)

    @operation
    def handle_stale(self, lease: Lease, error: StaleToken) -> Plan[bool]:
        return self.plans.handle_stale(lease, error)


class LeaseManager(_Shell[SyncRedisExecutor | SyncSqlExecutor]):
    """Acquire, renew, release and inspect leases (blocking API, for Celery workers and scripts)."""

    def __init__(
        self,
        core: LeaseCore,
        executor: SyncRedisExecutor | SyncSqlExecutor,
        *,
        clock: Clock = time.monotonic,
        url: str = "",
    ) -> None:
        super().__init__(core, executor, clock=clock, url=url)
        self._renewer = Renewer(self.renew)

    @classmethod
    def redis_executor(
        cls, topology: RedisTopology, sleep: Callable[[float], Any] | None, options: dict[str, Any]
    ) -> SyncRedisExecutor:
        return SyncRedisExecutor(_redis_client(sync_client, topology, options), sleep or time.sleep)

    @classmethod
    def sql_executor(
        cls, url: str, sleep: Callable[[float], Any] | None, options: dict[str, Any]
    ) -> SyncSqlExecutor:
        return SyncSqlExecutor(make_engine(url, **options), sleep or time.sleep)

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
        """Hold the lease for the block, renewed by this manager's background renewer thread.

        A failed renewal is asked again or marks the lease lost, as
        :func:`fencing.lease_plans.renewal_verdict` decides; once lost, the next guarded write raises
        without a round trip. A :class:`StaleToken` leaving the block triggers the regression repair check.
        """
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


class AsyncLeaseManager(_Shell[AsyncRedisExecutor | AsyncSqlExecutor]):
    """The asyncio shell: same plans, awaited I/O, renewal in a task instead of a thread."""

    awaits = True

    @classmethod
    def redis_executor(
        cls, topology: RedisTopology, sleep: Callable[[float], Any] | None, options: dict[str, Any]
    ) -> AsyncRedisExecutor:
        return AsyncRedisExecutor(_redis_client(async_client, topology, options), sleep or asyncio.sleep)

    @classmethod
    def sql_executor(
        cls, url: str, sleep: Callable[[float], Any] | None, options: dict[str, Any]
    ) -> AsyncSqlExecutor:
        return AsyncSqlExecutor(make_async_engine(url, **options), sleep or asyncio.sleep)

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
            wait = _renew_interval(lease, renew_every)
            while True:
                await asyncio.sleep(wait)
                try:
                    await self.renew(lease)
                except Exception as exc:
                    verdict = renewal_verdict(exc, lease.time_left())
                    if verdict.retry_in is None:
                        lease.mark_lost(verdict.reason)
                        return
                    wait = verdict.retry_in
                else:
                    wait = _renew_interval(lease, renew_every)

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
