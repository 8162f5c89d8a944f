"""Lease round trips: the Redis lease backend against a hand-written raw Redis lock, and the SQL and etcd
lease backends against the Redis one. One unit of work is an acquire followed by its release.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import redis
import redis.asyncio
import sqlalchemy as sa
from redis.commands.core import Script

from bench.env import Scratch
from bench.timing import Case, Op, Progress, Results, measure
from fencing import AsyncLeaseManager, LeaseManager
from fencing.lease import MAX_TOKEN
from fencing.manager import DEFAULT_HISTORY_CAP, DEFAULT_HISTORY_RETENTION
from fencing.redis_backend import ACQUIRE, RELEASE, scope_keys
from fencing.sql import SyncSqlExecutor
from fencing.sql_backend import lease_events
from testing.etcd_cluster import etcd_cluster

TTL = 5.0
TTL_MS = 5000
RETENTION_MS = round(DEFAULT_HISTORY_RETENTION * 1000)
HOLDER = "bench"

# The usual single-instance Redis lock release: delete the key only if it still holds our value.
COMPARE_AND_DELETE = (
    "if redis.call('get',KEYS[1])==ARGV[1] then return redis.call('del',KEYS[1]) else return 0 end"
)

LEASE_1 = "lease acquire+release, 1 scope"
LEASE_N = "lease acquire+release, new scope each"
RAW_1 = "SET NX PX + CAD script, 1 key"
RAW_N = "SET NX PX + CAD script, new key each"
DIRECT = "same Lua scripts, direct redis-py"
ASYNC_LEASE = "AsyncLeaseManager acquire+release, 1 scope"
ASYNC_RAW = "redis.asyncio SET NX PX + CAD script, 1 key"
REDIS_LEASE = "Redis lease acquire+release"
SQL_LEASE_PG = "SQL lease acquire+release, PostgreSQL"
SQL_LEASE_SQLITE = "SQL lease acquire+release, SQLite"

ETCD_LEASE_1 = "etcd lease acquire+release, 1 member"
ETCD_LEASE_3 = "etcd lease acquire+release, 3 members"
RAW_VS_ETCD = "raw Redis lock: SET NX PX + CAD script"

SQL_SCOPE = "vs-redis"

Names = Callable[[], str]


class UnexpectedReply(RuntimeError):
    """A step did not do what it must (lock not taken, not released): the timings would be void."""


def same(name: str) -> Names:
    return itertools.repeat(name).__next__


def fresh(name: str) -> Names:
    return (f"{name}:{n}" for n in itertools.count()).__next__


def lease_pair(manager: LeaseManager, scopes: Names) -> Op:
    def op() -> None:
        manager.release(manager.acquire(scopes(), ttl=TTL, holder=HOLDER))

    return op


def raw_pair(client: redis.Redis, compare_and_delete: Script, keys: Names) -> Op:
    def op() -> None:
        key = keys()
        value = secrets.token_hex(16)  # a fresh owner id per acquisition, like the library's lease id
        if not client.set(key, value, nx=True, px=TTL_MS):
            raise UnexpectedReply(f"SET NX did not take {key}")
        if compare_and_delete(keys=[key], args=[value]) != 1:
            raise UnexpectedReply(f"compare-and-delete did not delete {key}")

    return op


def async_lease_pair(loop: asyncio.AbstractEventLoop, manager: AsyncLeaseManager, scopes: Names) -> Op:
    async def pair() -> None:
        await manager.release(await manager.acquire(scopes(), ttl=TTL, holder=HOLDER))

    return lambda: loop.run_until_complete(pair())


def async_raw_pair(
    loop: asyncio.AbstractEventLoop, client: redis.asyncio.Redis, compare_and_delete: Any, keys: Names
) -> Op:
    async def pair() -> None:
        key = keys()
        value = secrets.token_hex(16)
        if not await client.set(key, value, nx=True, px=TTL_MS):
            raise UnexpectedReply(f"SET NX did not take {key}")
        if await compare_and_delete(keys=[key], args=[value]) != 1:
            raise UnexpectedReply(f"compare-and-delete did not delete {key}")

    return lambda: loop.run_until_complete(pair())


def direct_pair(client: redis.Redis, prefix: str, scope: str) -> Op:
    """The library's own ACQUIRE and RELEASE scripts without the library around them: the gap to the
    lease row is the client-side cost (validation, plans, Lease objects), the gap to the raw row the
    server-side cost (token hash, history entry)."""
    acquire = client.register_script(ACQUIRE)
    release = client.register_script(RELEASE)
    keys = scope_keys(prefix, scope)

    def op() -> None:
        lease_id = secrets.token_hex(16)
        reply = acquire(
            keys=keys,
            args=[lease_id, HOLDER, TTL_MS, DEFAULT_HISTORY_CAP, MAX_TOKEN, RETENTION_MS],
        )
        if not isinstance(reply, int):  # a bare token when acquired, a list otherwise
            raise UnexpectedReply(f"ACQUIRE replied {reply!r}")
        reply = release(keys=keys[:2], args=[lease_id])
        if not isinstance(reply, int):  # a bare contended flag when released, a list otherwise
            raise UnexpectedReply(f"RELEASE replied {reply!r}")

    return op


def _scope_footprint(client: redis.Redis, prefix: str, scope: str) -> int:
    keys = scope_keys(prefix, scope)
    return sum(client.memory_usage(key, samples=0) or 0 for key in (keys.state, keys.log))


def _event_rows(manager: LeaseManager, scope: str) -> int:
    executor = manager.executor
    assert isinstance(executor, SyncSqlExecutor)
    with executor.engine.connect() as conn:
        count = sa.select(sa.func.count()).where(lease_events.c.scope == scope)
        return int(conn.execute(count).scalar_one())


def redis_vs_raw(
    scratch: Scratch,
    results: Results,
    *,
    iterations: int,
    warmup: int,
    repeats: int,
    progress: Progress | None = None,
) -> None:
    section = "Redis lease vs raw Redis lock (acquire+release pairs)"
    prefix = scratch.redis_prefix
    with ExitStack() as stack:
        manager = stack.enter_context(scratch.redis_manager())
        client = scratch.redis_client()
        stack.callback(client.close)
        cad = client.register_script(COMPARE_AND_DELETE)

        one = measure(
            [
                Case(LEASE_1, lease_pair(manager, same("one"))),
                Case(RAW_1, raw_pair(client, cad, same(f"{prefix}:raw:one"))),
                Case(DIRECT, direct_pair(client, prefix, "direct")),
            ],
            iterations=iterations,
            warmup=warmup,
            repeats=repeats,
            progress=progress,
        )
        results.add(section, one, LEASE_1, RAW_1)

        many = measure(
            [
                Case(LEASE_N, lease_pair(manager, fresh("many"))),
                Case(RAW_N, raw_pair(client, cad, fresh(f"{prefix}:raw:many"))),
            ],
            iterations=iterations,
            warmup=warmup,
            repeats=repeats,
            progress=progress,
        )
        results.add(section, many, LEASE_N, RAW_N)
        results.add(section, one, LEASE_1, DIRECT)

        # The asyncio shells on one event loop: each pair runs to completion on it, for both cases.
        loop = asyncio.new_event_loop()
        stack.callback(loop.close)
        async_manager = AsyncLeaseManager.from_url(scratch.settings.redis_url, prefix=prefix)
        stack.callback(lambda: loop.run_until_complete(async_manager.close()))
        async_client = redis.asyncio.Redis.from_url(scratch.settings.redis_url, decode_responses=True)
        stack.callback(lambda: loop.run_until_complete(async_client.aclose()))
        async_cad = async_client.register_script(COMPARE_AND_DELETE)
        asynchronous = measure(
            [
                Case(ASYNC_LEASE, async_lease_pair(loop, async_manager, same("async-one"))),
                Case(ASYNC_RAW, async_raw_pair(loop, async_client, async_cad, same(f"{prefix}:raw:async"))),
            ],
            iterations=iterations,
            warmup=warmup,
            repeats=repeats,
            progress=progress,
        )
        results.add(section, asynchronous, ASYNC_LEASE, ASYNC_RAW)

        fresh_scope = _scope_footprint(client, prefix, "many:0")
        busy_scope = _scope_footprint(client, prefix, "one")
        pairs = warmup + iterations * repeats
        results.notes.append(
            f"'{DIRECT}' runs the library's ACQUIRE/RELEASE scripts without the library: the lease "
            "row's gap to it is client-side cost, its gap to the raw lock is server-side cost."
        )
        results.notes.append(
            "After release each Redis scope keeps its token hash (never expires: it keeps tokens "
            f"monotonic) and a log of its last {DEFAULT_HISTORY_CAP} epochs (expires after "
            f"{DEFAULT_HISTORY_RETENTION / 86400:.0f} idle days), by MEMORY USAGE: {fresh_scope} bytes "
            f"after one acquire+release, {busy_scope} bytes after {pairs}; the raw lock keeps none."
        )


def sql_vs_redis_leases(
    scratch: Scratch,
    results: Results,
    *,
    postgres: bool,
    sqlite: bool,
    iterations: int,
    warmup: int,
    repeats: int,
    progress: Progress | None = None,
) -> None:
    section = "SQL lease backend vs Redis lease backend (acquire+release pairs)"
    with ExitStack() as stack:
        redis_manager = stack.enter_context(scratch.redis_manager())
        cases = [Case(REDIS_LEASE, lease_pair(redis_manager, same("vs-sql")))]
        sql_cases = [
            (SQL_LEASE_PG, scratch.postgres_url if postgres else None),
            (SQL_LEASE_SQLITE, scratch.sqlite_url if sqlite else None),
        ]
        sql_managers: dict[str, LeaseManager] = {}
        for name, url_of in sql_cases:
            if url_of is None:
                continue
            manager = sql_managers[name] = stack.enter_context(LeaseManager.from_url(url_of()))
            manager.create_schema()
            cases.append(Case(name, lease_pair(manager, same(SQL_SCOPE))))
        if not sql_managers:
            return
        stats = measure(cases, iterations=iterations, warmup=warmup, repeats=repeats, progress=progress)
        pairs = warmup + iterations * repeats
        for name, manager in sql_managers.items():
            results.add(section, stats, name, REDIS_LEASE)
            rows = _event_rows(manager, SQL_SCOPE)
            results.notes.append(
                f"{name}: fencing_lease_events holds {rows} rows for the scope after {pairs} "
                "pairs; the SQL backend adds a row per acquire and release, trimmed by "
                "purge_history's retention (history_cap only caps the Redis log)."
            )


def etcd_version() -> str:
    done = subprocess.run(["etcd", "--version"], capture_output=True, text=True, timeout=10, check=False)
    return done.stdout.splitlines()[0].removeprefix("etcd Version: ") if done.stdout else "unknown"


def etcd_vs_redis_leases(
    scratch: Scratch,
    results: Results,
    *,
    iterations: int,
    warmup: int,
    repeats: int,
    progress: Progress | None = None,
) -> None:
    """The etcd lease backend beside the Redis one and the raw Redis lock, on private etcd clusters of
    one member (like for like: the Redis rows are one redis-server) and of three (as deployed). Needs the
    ``etcd`` binary and Redis; the caller checks both."""
    section = "etcd lease backend vs Redis lease backend and raw Redis lock (acquire+release pairs)"
    prefix = scratch.redis_prefix
    with ExitStack() as stack:
        folder = Path(tempfile.mkdtemp(prefix="fencing-bench-etcd-"))
        stack.callback(shutil.rmtree, folder, ignore_errors=True)
        if progress:
            progress("  starting private etcd clusters of 1 and 3 members")
        (folder / "one").mkdir()
        (folder / "three").mkdir()
        one = stack.enter_context(etcd_cluster(folder / "one", size=1))
        three = stack.enter_context(etcd_cluster(folder / "three", size=3))
        redis_manager = stack.enter_context(scratch.redis_manager())
        client = scratch.redis_client()
        stack.callback(client.close)
        cad = client.register_script(COMPARE_AND_DELETE)
        single = stack.enter_context(LeaseManager.from_url(one.url("bench")))
        triple = stack.enter_context(LeaseManager.from_url(three.url("bench")))
        stats = measure(
            [
                Case(REDIS_LEASE, lease_pair(redis_manager, same("vs-etcd"))),
                Case(RAW_VS_ETCD, raw_pair(client, cad, same(f"{prefix}:raw:vs-etcd"))),
                Case(ETCD_LEASE_1, lease_pair(single, same("vs-redis"))),
                Case(ETCD_LEASE_3, lease_pair(triple, same("vs-redis"))),
            ],
            iterations=iterations,
            warmup=warmup,
            repeats=repeats,
            progress=progress,
        )
        results.add(section, stats, ETCD_LEASE_1, REDIS_LEASE)
        results.add(section, stats, ETCD_LEASE_3, REDIS_LEASE)
        results.add(section, stats, ETCD_LEASE_1, RAW_VS_ETCD)
        results.add(section, stats, ETCD_LEASE_3, ETCD_LEASE_1)
    results.notes.append(
        f"etcd {etcd_version()} (Debian etcd-server), private clusters on loopback, data directories on "
        f"{tempfile.gettempdir()}'s file system, default flags: an etcd pair is a linearizable read, a lease "
        "grant, a create-if-absent transaction and a revoke, three of them consensus writes that the "
        "leader (and, with three members, a follower) fsyncs before answering; a Redis pair is two scripts "
        "on one redis-server that writes no file before answering."
    )
