"""The clients a lease URL's topology is reached through, and the sync and async shells that run Redis
plans on them.

A lease pair is two script calls, so what redis-py does around each call counts as much as the call: on
one server or a Sentinel-managed primary the sync shell sends a script's EVALSHA itself, packed here, on a
connection it keeps between calls (:class:`_Wire`). redis-py's own client layer (taking the connection
from the pool and giving it back, its command metrics, the script object) costs more than the round trip
to a local Redis; what it does for a connection's health is kept: the same connections and their retry
policy, the check for a connection the server closed, Sentinel's READONLY handling. A Cluster client
routes by slot, so a Cluster keeps redis-py's path.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Awaitable, Callable
from contextlib import nullcontext
from typing import Any, TypeAlias

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel
from redis.exceptions import NoScriptError

from fencing.plan import (
    Atomic,
    Command,
    Op,
    Plan,
    ScriptCall,
    ScriptCalls,
    Sleep,
    T,
    foreign,
    run_async,
    run_sync,
)
from fencing.redis_outage import outage, unavailable
from fencing.redis_topology import RedisTopology

SyncClient: TypeAlias = redis.Redis | redis.cluster.RedisCluster
AsyncClient: TypeAlias = redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster


def sync_client(topology: RedisTopology, options: dict[str, Any]) -> SyncClient | Callable[[], SyncClient]:
    """The blocking client for ``topology`` with the caller's ``options`` (socket timeouts...), or for a
    Cluster the function that builds it: redis-py's Cluster client asks a node for the slot map as it is
    built, and a cluster that does not answer yet must fail an operation as BackendUnavailable, not the
    building of a lease manager (:class:`SyncRedisExecutor` calls it on first use)."""
    auth = topology.auth()
    if topology.kind == "server":
        return redis.Redis.from_url(topology.url, decode_responses=True, **options)
    if topology.kind == "sentinel":
        sentinels = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
            list(topology.nodes), sentinel_kwargs=_sentinel_options(options, auth)
        )
        client: redis.Redis = sentinels.master_for(  # type: ignore[no-untyped-call]
            topology.service, db=topology.db, decode_responses=True, **auth, **options
        )
        return client
    nodes = [redis.cluster.ClusterNode(host, port) for host, port in topology.nodes]  # type: ignore[no-untyped-call]
    return lambda: redis.cluster.RedisCluster(startup_nodes=nodes, decode_responses=True, **auth, **options)


def async_client(topology: RedisTopology, options: dict[str, Any]) -> AsyncClient:
    """The asyncio client for ``topology``; each of them connects on first use."""
    auth = topology.auth()
    if topology.kind == "server":
        return redis.asyncio.Redis.from_url(topology.url, decode_responses=True, **options)
    if topology.kind == "sentinel":
        sentinels = redis.asyncio.sentinel.Sentinel(  # type: ignore[no-untyped-call]
            list(topology.nodes), sentinel_kwargs=_sentinel_options(options, auth)
        )
        client: redis.asyncio.Redis = sentinels.master_for(
            topology.service, db=topology.db, decode_responses=True, **auth, **options
        )
        return client
    nodes = [redis.asyncio.cluster.ClusterNode(host, port) for host, port in topology.nodes]
    return redis.asyncio.cluster.RedisCluster(startup_nodes=nodes, decode_responses=True, **auth, **options)


def _sentinel_options(options: dict[str, Any], auth: dict[str, Any]) -> dict[str, Any]:
    """How the sentinels are asked for the primary: with the socket options and retry policy the data
    nodes get, as redis-py does when given none (a silent sentinel costs no more than a silent primary),
    and the URL's user and password."""
    return {**{k: v for k, v in options.items() if k.startswith("socket_") or k == "retry"}, **auth}


def _sentinels(client: object) -> Any:
    """The ``Sentinel`` a Sentinel-managed client asks for its primary, None for other clients: it holds
    connections of its own, to the sentinels, closed with the client's."""
    return getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(value), value)


class _Script:
    """A script as EVALSHA names it: its SHA1, computed here rather than asked of a server."""

    __slots__ = ("load", "sha")

    def __init__(self, source: str) -> None:
        self.sha = hashlib.sha1(source.encode()).hexdigest().encode()
        self.load = b"*3\r\n$6\r\nSCRIPT\r\n$4\r\nLOAD\r\n" + _bulk(source.encode())

    def call(self, keys: tuple[str, ...], args: tuple[str | int, ...]) -> bytes:
        """The EVALSHA command, in the protocol: keys and text as UTF-8 (what the client encodes them to),
        numbers as their decimal text."""
        parts = [
            b"*%d\r\n$7\r\nEVALSHA\r\n" % (3 + len(keys) + len(args)),
            _bulk(self.sha),
            _bulk(b"%d" % len(keys)),
        ]
        parts.extend(_bulk(key.encode()) for key in keys)
        parts.extend(_bulk(b"%d" % arg if isinstance(arg, int) else arg.encode()) for arg in args)
        return b"".join(parts)


class _Wire:
    """Script calls sent straight on connections of a :class:`redis.Redis` client's pool, kept here between
    calls, one per caller at a time (the renewer thread and the caller's)."""

    def __init__(self, client: redis.Redis) -> None:
        self._pool = client.connection_pool
        self._idle: list[Any] = []
        self._pid = os.getpid()

    def _take(self) -> Any:
        if self._pid != os.getpid():
            # A forked child: the sockets kept are its parent's. The pool resets itself likewise.
            self._idle, self._pid = [], os.getpid()
        try:
            conn = self._idle.pop()
        except IndexError:
            return self._pool.get_connection()
        try:
            stale = conn.can_read()  # data no call asked for; or the server closed it, seen as an error
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            stale = True
        if stale:
            conn.disconnect()  # the send connects again, under the retry policy
        return conn

    def _give(self, conn: Any) -> None:
        if conn.should_reconnect():
            conn.disconnect()
        self._idle.append(conn)

    def run(self, script: _Script, keys: tuple[str, ...], args: tuple[str | int, ...]) -> Any:
        command = script.call(keys, args)
        conn = self._take()
        try:
            return conn.retry.call_with_retry(
                lambda: _ask(conn, script, command), lambda _: conn.disconnect()
            )
        finally:
            self._give(conn)

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            self._pool.release(conn)


def _ask(conn: Any, script: _Script, command: bytes) -> Any:
    conn.send_packed_command((command,))
    try:
        return conn.read_response()
    except NoScriptError:
        # A server that has not seen the script (restarted, a new primary): load it, ask again.
        conn.send_packed_command((script.load,))
        conn.read_response()
        conn.send_packed_command((command,))
        return conn.read_response()


class SyncRedisExecutor:
    """Runs plans on a blocking Redis client (one server, a Sentinel-managed primary, a Cluster); scripts
    registered once per client. ``client`` may be a function building it, called on first use
    (:func:`sync_client` says why)."""

    def __init__(self, client: SyncClient | Callable[[], SyncClient], sleep: Callable[[float], None]) -> None:
        self._client: SyncClient | None = None
        self._build: Callable[[], SyncClient] | None = None
        if isinstance(client, redis.Redis | redis.cluster.RedisCluster):
            self._client = client
        else:
            self._build = client
        self._lock = threading.Lock()  # the renewer thread and the caller's may both be first
        self._sleep = sleep
        self._scripts: dict[str, Any] = {}
        self._registered: dict[str, Any] = {}  # redis-py's script objects, for pipelines
        # Script calls on one server or a Sentinel-managed primary go straight to a connection.
        self._wire = _Wire(client) if isinstance(client, redis.Redis) else None

    @property
    def client(self) -> SyncClient:
        if self._client is None:
            with self._lock:
                if self._client is None and self._build is not None:
                    self._client = self._build()
        assert self._client is not None
        return self._client

    def run(self, plan: Plan[T]) -> T:
        return run_sync(plan, self._handle)

    def unit(self) -> nullcontext[Callable[[Op], Any]]:
        """Redis has no transaction around a plan: each script is atomic on its own."""
        return nullcontext(self._handle)

    def _handle(self, op: Op) -> Any:
        if isinstance(op, Sleep):
            return self._sleep(op.seconds)
        if isinstance(op, Atomic):
            return self.run(op.plan)
        if not isinstance(op, ScriptCall | ScriptCalls | Command):
            raise foreign("Redis", op)
        try:
            if isinstance(op, ScriptCalls):
                return self._calls(op)
            if isinstance(op, ScriptCall):
                script = self._scripts.get(op.source)
                if self._wire is not None:
                    if script is None:
                        script = self._scripts[op.source] = _Script(op.source)
                    return self._wire.run(script, op.keys, op.args)
                if script is None:
                    script = self._scripts[op.source] = self.client.register_script(op.source)
                return script(keys=op.keys, args=op.args)
            return self.client.execute_command(*op.args)  # type: ignore[no-untyped-call]
        except Exception as exc:
            if outage(exc):
                raise unavailable(op, exc) from exc
            raise

    def _calls(self, op: ScriptCalls) -> list[Any]:
        script = self._registered.get(op.source)
        if script is None:
            script = self._registered[op.source] = self.client.register_script(op.source)
        client = self.client
        if isinstance(client, redis.cluster.RedisCluster):
            return [script(keys=keys, args=args) for keys, args in op.calls]
        pipe = client.pipeline(transaction=False)
        for keys, args in op.calls:
            script(keys=keys, args=args, client=pipe)
        return pipe.execute()

    def close(self) -> None:
        if self._wire is not None:
            self._wire.close()
        if self._client is not None:
            self._client.close()
            sentinels = _sentinels(self._client)
            if sentinels is not None:
                sentinels.close()


class AsyncRedisExecutor:
    """The async shell of :class:`SyncRedisExecutor` over an asyncio client, which connects on first use
    of its own."""

    def __init__(self, client: AsyncClient, sleep: Callable[[float], Awaitable[Any]]) -> None:
        self._client = client
        self._sleep = sleep
        self._scripts: dict[str, Any] = {}

    @property
    def client(self) -> AsyncClient:
        return self._client

    async def run(self, plan: Plan[T]) -> T:
        return await run_async(plan, self._handle)

    async def _handle(self, op: Op) -> Any:
        if isinstance(op, Sleep):
            return await self._sleep(op.seconds)
        if isinstance(op, Atomic):
            return await self.run(op.plan)
        if not isinstance(op, ScriptCall | ScriptCalls | Command):
            raise foreign("Redis", op)
        try:
            if isinstance(op, ScriptCall | ScriptCalls):
                script = self._scripts.get(op.source)
                if script is None:
                    script = self._scripts[op.source] = self.client.register_script(op.source)
                if isinstance(op, ScriptCalls):
                    return await self._calls(script, op)
                return await script(keys=op.keys, args=op.args)
            return await self.client.execute_command(*op.args)
        except Exception as exc:
            if outage(exc):
                raise unavailable(op, exc) from exc
            raise

    async def _calls(self, script: Any, op: ScriptCalls) -> list[Any]:
        client = self.client
        if isinstance(client, redis.asyncio.cluster.RedisCluster):
            return [await script(keys=keys, args=args) for keys, args in op.calls]
        async with client.pipeline(transaction=False) as pipe:
            for keys, args in op.calls:
                await script(keys=keys, args=args, client=pipe)
            return await pipe.execute()

    async def close(self) -> None:
        await self.client.aclose()
        sentinels = _sentinels(self.client)
        if sentinels is not None:
            await sentinels.aclose()
