"""Redis as the lease backend reaches it: where a lease URL puts the keys (:class:`RedisTopology`), the
clients that reach them, which of their errors are an outage, and the sync and async shells that run
Redis plans on them (script calls on one server or a Sentinel-managed primary go through :class:`_Wire`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from collections.abc import Awaitable, Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, TypeAlias, cast
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    SlotNotCoveredError,
    TryAgainError,
)

from fencing.errors import BackendUnavailable, InvalidLeaseRequest
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
from fencing.urls import mask_url

SERVER_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEME = "redis+sentinel"
CLUSTER_SCHEME = "redis+cluster"
REDIS_SCHEMES = (*SERVER_SCHEMES, SENTINEL_SCHEME, CLUSTER_SCHEME)
_FORMS = {
    SENTINEL_SCHEME: "redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]",
    CLUSTER_SCHEME: "redis+cluster://[[user]:password@]host:port[,host:port...]",
}
_DEFAULT_PORTS = {SENTINEL_SCHEME: 26379, CLUSTER_SCHEME: 6379}
_NOT_IN_HOST = frozenset(" \t/?#@[],")


@dataclass(frozen=True, slots=True)
class RedisTopology:
    """Where a lease URL puts the lease keys, read from the URL without connecting (:func:`redis_topology`;
    docs/operations.md, "Redis Sentinel and Cluster for leases").

    ``server``: one Redis server, ``redis://``, ``rediss://`` or ``unix://``, handed to redis-py as it is.
    ``sentinel`` (``_FORMS`` gives the URL): the sentinels at ``nodes`` name the primary of ``service``.
    ``cluster``: any reachable node of ``nodes`` gives the slot map; every lease script touches one slot
    (:mod:`fencing.redis_backend`). The user and password are the data nodes', sent to the sentinels too
    (a sentinel's ``requirepass`` is also what sentinels use with one another).
    """

    kind: str
    url: str
    nodes: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None

    def auth(self) -> dict[str, Any]:
        found = {"username": self.username, "password": self.password}
        return {name: value for name, value in found.items() if value is not None}


def redis_topology(url: str) -> RedisTopology:
    """The topology a Redis lease URL names; :class:`InvalidLeaseRequest` saying what is wrong with it
    when it is malformed (a port, a database number, a missing service)."""
    scheme = url.partition("://")[0].lower()
    if scheme in SERVER_SCHEMES:
        try:
            redis.connection.parse_url(url)  # type: ignore[no-untyped-call]
        except ValueError as exc:  # a malformed port or database number
            raise InvalidLeaseRequest(f"not a usable Redis URL: {mask_url(url)} ({exc})") from None
        return RedisTopology("server", url)
    if scheme not in _FORMS:
        raise InvalidLeaseRequest(f"not a Redis URL: {mask_url(url)}")
    try:
        return _multi_node(scheme, url)
    except ValueError as exc:
        raise InvalidLeaseRequest(
            f"not a usable Redis URL: {mask_url(url)} ({exc}; use {_FORMS[scheme]})"
        ) from None


def _multi_node(scheme: str, url: str) -> RedisTopology:
    """A Sentinel or Cluster URL's parts; ValueError naming the first that is wrong."""
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise ValueError("it takes no query options")
    # The host list starts after the last "@", where redis-py looks for a server's host too.
    userinfo, at, hosts = parts.netloc.rpartition("@")
    username, colon, password = userinfo.partition(":")
    nodes = tuple(_node(text, _DEFAULT_PORTS[scheme]) for text in hosts.split(","))
    user = unquote(username) or None if at else None
    secret = unquote(password) or None if colon else None
    path = parts.path.strip("/")
    if scheme == CLUSTER_SCHEME:
        if path not in ("", "0"):
            raise ValueError("a Redis Cluster has one database, 0")
        return RedisTopology("cluster", url, nodes, username=user, password=secret)
    service, _, db = path.partition("/")
    if not service or not service.isprintable() or any(c.isspace() for c in service):
        raise ValueError("the path must name the service the sentinels monitor")
    if db and not (db.isascii() and db.isdigit()):
        raise ValueError(f"the database after the service must be a number, not {db!r}")
    return RedisTopology("sentinel", url, nodes, service, int(db or 0), username=user, password=secret)


def _node(text: str, default_port: int) -> tuple[str, int]:
    """``host:port``, ``host`` or ``[v6 address]:port`` as (host, port)."""
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"{text!r} is not [address]:port")
        port = rest[1:]
    else:
        host, colon, port = text.rpartition(":")
        if not colon:
            host, port = text, ""
    if not host or _NOT_IN_HOST & set(host):
        raise ValueError(f"{text!r} is not host:port")
    if not port:
        return host, default_port
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"the port of {text!r} is not a number from 1 to 65535")
    return host, int(port)


# What Redis says "not now" with: the call did not run and can succeed once a failover, a resharding or a
# restart is over (docs/operations.md, "Redis Sentinel and Cluster for leases"). redis-py raises a class of
# its own for the answers it knows, and some never reach this code: a Sentinel client turns READONLY into
# a ConnectionError and asks the sentinels again; a Cluster client follows MOVED and ASK, waits out
# TRYAGAIN and CLUSTERDOWN, and raises only once it has run out of tries; LOADING is a ConnectionError.
_NOT_NOW_TYPES = (
    ReadOnlyError,  # READONLY: a replica, or a primary demoted to one
    TryAgainError,  # TRYAGAIN: a slot being migrated holds some of a script's keys on each node
    AskError,  # ASK, and MOVED (a subclass): a slot being migrated, or moved
    ClusterDownError,  # CLUSTERDOWN: a slot without a node; MASTERDOWN (a subclass): a replica cut off
    OutOfMemoryError,  # OOM: maxmemory reached, until keys expire
)
# ... and those it leaves as a plain ResponseError, its code first.
_NOT_NOW_CODES = frozenset(
    {
        "MISCONF",  # a failed snapshot stops writes until one succeeds
        "BUSY",  # a script is running past its time limit
        "NOREPLICAS",  # fewer replicas connected than min-replicas-to-write asks for
    }
)


def outage(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a redis-py client, means Redis could not serve the call now: no connection
    or answer in time, or a "not now" answer (above). Any other answer (a script error, WRONGTYPE, a call
    whose keys span slots) is a refusal that no wait changes, so it is not an outage."""
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, SlotNotCoveredError, *_NOT_NOW_TYPES)):
        return True
    if isinstance(exc, redis.ResponseError):
        return str(exc).split(" ", 1)[0] in _NOT_NOW_CODES
    if isinstance(exc, ClusterError):
        # "TTL exhausted": the Cluster client was redirected, or told to wait, more often than it follows.
        return True
    if isinstance(exc, RedisClusterException):
        # The Cluster client's own: an outage when its cause is one (no node could be reached for the slot
        # map), else a call it cannot route.
        cause = exc.__cause__ or exc.__context__
        return cause is not None and outage(cause)
    return False


def unavailable(op: ScriptCall | ScriptCalls | Command, exc: Exception) -> BackendUnavailable:
    """What callers hear of ``op`` meeting an outage: the error names the call's kind and the cause."""
    name = "command" if isinstance(op, Command) else "script"
    return BackendUnavailable(backend="redis", operation=name, detail=f"{type(exc).__name__}: {exc}")


SyncClient: TypeAlias = redis.Redis | redis.cluster.RedisCluster
AsyncClient: TypeAlias = redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster


def redis_client(topology: RedisTopology, options: dict[str, Any], *, asynchronous: bool = False) -> Any:
    """The client of ``redis`` (``redis.asyncio`` if ``asynchronous``) for ``topology`` with the caller's
    ``options`` (socket timeouts...); InvalidLeaseRequest for a malformed port, database number or option.
    A blocking Cluster client comes as the function that builds it, which :class:`SyncRedisExecutor` calls
    on first use: redis-py's asks a node for the slot map as it is built, and a cluster that does not answer
    yet must fail an operation as BackendUnavailable, not the building of a lease manager. Every other
    client connects on first use of its own."""
    lib: Any = redis.asyncio if asynchronous else redis
    auth = topology.auth()
    try:
        if topology.kind == "server":
            return lib.Redis.from_url(topology.url, decode_responses=True, **options)
        if topology.kind == "sentinel":
            # The sentinels are asked for the primary with the socket options and retry policy the data
            # nodes get, as redis-py does when given none (a silent sentinel costs no more than a silent
            # primary), and the URL's user and password.
            asked = {k: v for k, v in options.items() if k.startswith("socket_") or k == "retry"}
            sentinels = lib.sentinel.Sentinel(list(topology.nodes), sentinel_kwargs={**asked, **auth})
            return sentinels.master_for(
                topology.service, db=topology.db, decode_responses=True, **auth, **options
            )
        nodes = [lib.cluster.ClusterNode(host, port) for host, port in topology.nodes]
        cluster = functools.partial(
            lib.cluster.RedisCluster, startup_nodes=nodes, decode_responses=True, **auth, **options
        )
        return cluster() if asynchronous else cluster
    except ValueError as exc:
        raise InvalidLeaseRequest(f"not a usable Redis URL: {mask_url(topology.url)} ({exc})") from None


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
    calls, one per caller at a time (the renewer thread and the caller's), as EVALSHA packed here.

    A lease pair is two script calls, and redis-py's client layer around each (the pool's take and give
    back, its command metrics, the script object) costs more than the round trip to a local Redis. What it
    does for a connection's health is kept: the pool's connections and their retry policy, the check for a
    connection the server closed, Sentinel's READONLY handling. A Cluster client routes by slot, so a
    Cluster keeps redis-py's path."""

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

    def run(self, script: _Script, keys: tuple[str, ...], args: tuple[str | int, ...]) -> Any:
        command = script.call(keys, args)
        conn = self._take()
        try:
            return conn.retry.call_with_retry(
                lambda: _ask(conn, script, command), lambda _: conn.disconnect()
            )
        finally:
            if conn.should_reconnect():
                conn.disconnect()
            self._idle.append(conn)

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
    (:func:`redis_client` says why)."""

    def __init__(self, client: SyncClient | Callable[[], SyncClient], sleep: Callable[[float], None]) -> None:
        self._client = client if isinstance(client, redis.Redis | redis.cluster.RedisCluster) else None
        self._build = cast(Callable[[], SyncClient], client)
        self._lock = threading.Lock()  # the renewer thread and the caller's may both be first
        self._sleep = sleep
        self._scripts: dict[str, Any] = {}  # redis-py's script objects
        self._wired: dict[str, _Script] = {}
        # Script calls on one server or a Sentinel-managed primary go straight to a connection.
        self._wire = _Wire(client) if isinstance(client, redis.Redis) else None

    @property
    def client(self) -> SyncClient:
        if self._client is None:
            with self._lock:
                if self._client is None:
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
            if isinstance(op, ScriptCall) and self._wire is not None:
                wired = self._wired.get(op.source) or self._wired.setdefault(op.source, _Script(op.source))
                return self._wire.run(wired, op.keys, op.args)
            if isinstance(op, Command):
                return self.client.execute_command(*op.args)  # type: ignore[no-untyped-call]
            script = self._scripts.get(op.source)
            if script is None:
                script = self._scripts[op.source] = self.client.register_script(op.source)
            if isinstance(op, ScriptCall):
                return script(keys=op.keys, args=op.args)
            return self._calls(script, op)
        except Exception as exc:
            if outage(exc):
                raise unavailable(op, exc) from exc
            raise

    def _calls(self, script: Any, op: ScriptCalls) -> list[Any]:
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
