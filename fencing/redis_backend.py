"""Redis lease backend: every operation is one Lua script, one round trip, one cluster slot.

The token counter lives in a hash that never expires, apart from the lease key that does, so an expired
lease never resets the count. History is a short list per scope written by the same scripts, one entry
per epoch, expiring with the scope's idleness (see the scripts' comment).

The lease URL names where the keys live (:func:`redis_topology`): one server, a primary found through
Redis Sentinel, or a Redis Cluster. Whichever it is, a Redis answer that means "not now" (a failover or a
resharding under way) reaches callers as :class:`BackendUnavailable`, like a lost connection
(:func:`outage`); any other error Redis answers is not an outage and stays redis-py's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeAlias
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
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    SlotNotCoveredError,
    TryAgainError,
)

from fencing.errors import BackendUnavailable, InvalidLeaseRequest, LeaseBusy, LeaseLost, TokenOverflow
from fencing.keys import ScopeKeys, scope_keys
from fencing.lease import MAX_TOKEN, Clock, Lease, LeaseEvent, LeaseInfo, parse_token, validate_token
from fencing.plan import Atomic, Command, Op, Plan, ScriptCall, Sleep, T, foreign, run_async, run_sync
from fencing.redis_scripts import ACQUIRE, BREAK, CURRENT, HISTORY, RELEASE, RENEW, REPAIR, Reply
from fencing.urls import mask_url

log = logging.getLogger("fencing")


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


class RedisLeaseCore:
    """Decisions and parsing for the Redis backend; no I/O."""

    backend = "redis"

    def __init__(
        self, *, prefix: str, history_cap: int, history_retention_ms: int, clock: Clock, cluster: bool = False
    ) -> None:
        self.prefix = prefix
        self.history_cap = history_cap
        self.history_retention_ms = history_retention_ms
        self.clock = clock
        self.cluster = cluster  # the keys are spread over a Redis Cluster's nodes

    def _keys(self, scope: str) -> ScopeKeys:
        return scope_keys(self.prefix, scope)

    def acquire(self, scope: str, ttl: float, holder: str, lease_id: str) -> Plan[Lease | LeaseBusy]:
        sent_at = self.clock()
        reply = yield ScriptCall(
            ACQUIRE,
            self._keys(scope).all,
            (lease_id, holder, _ms(ttl), self.history_cap, MAX_TOKEN, self.history_retention_ms),
        )
        if int(reply[0]) == Reply.OUT_OF_RANGE:
            raise _exhausted(scope, reply[1])
        if int(reply[0]) == Reply.BUSY:
            return LeaseBusy(
                scope=scope,
                holder=reply[1] or None,
                token=int(reply[2]) or None,
                retry_after=max(int(reply[3]), 0) / 1000,
            )
        return Lease(scope, int(reply[1]), lease_id, holder, ttl, sent_at, clock=self.clock)

    def renew(self, lease: Lease) -> Plan[Lease]:
        sent_at = self.clock()
        keys = self._keys(lease.scope)
        reply = yield ScriptCall(RENEW, (keys.lease, keys.state), (lease.lease_id, _ms(lease.ttl)))
        if int(reply[0]) != Reply.OK or int(reply[1]) != lease.token:
            raise _not_held(lease, int(reply[1]))
        lease._renewed(sent_at)
        return lease

    def release(self, lease: Lease) -> Plan[bool]:
        keys = self._keys(lease.scope)
        reply = yield ScriptCall(RELEASE, (keys.lease, keys.state), (lease.lease_id,))
        if int(reply[0]) != Reply.OK:
            raise _not_held(lease, int(reply[1]))
        return bool(int(reply[2]))

    def break_lease(self, scope: str, reason: str) -> Plan[LeaseInfo | None]:
        reply = yield ScriptCall(
            BREAK, self._keys(scope).all, (reason, self.history_cap, self.history_retention_ms)
        )
        if int(reply[0]) != Reply.OK:
            return None
        return LeaseInfo(scope=scope, token=int(reply[1]), holder=reply[2], time_left=0.0)

    def repair(self, lease: Lease, highest: int) -> Plan[tuple[int, int] | None]:
        validate_token(highest, scope=lease.scope)
        reply = yield ScriptCall(
            REPAIR,
            self._keys(lease.scope).all,
            (lease.lease_id, highest, self.history_cap, MAX_TOKEN, self.history_retention_ms),
        )
        if int(reply[0]) == Reply.OUT_OF_RANGE:
            raise TokenOverflow(token=highest, limit=MAX_TOKEN, scope=lease.scope)
        if int(reply[0]) != Reply.OK:
            return None
        return int(reply[1]), int(reply[2])

    def current(self, scope: str) -> Plan[LeaseInfo | None]:
        reply = yield ScriptCall(CURRENT, self._keys(scope).all, ())
        if not reply:
            return None
        return LeaseInfo(
            scope=scope, token=int(reply[0]), holder=reply[1], time_left=max(int(reply[2]), 0) / 1000
        )

    def purge_history(self, older_than_ms: int) -> Plan[int]:
        """Each scope's history expires by itself; this only removes the per-scope event streams that
        versions before the short history kept, which nothing reads or trims any more. Those versions could
        not run on a Redis Cluster, so there is nothing to remove on one (and no single SCAN cursor)."""
        if self.cluster:
            return 0
        removed, cursor = 0, "0"
        pattern = f"{self.prefix}:*:events"
        while True:
            cursor, keys = yield Command(("SCAN", cursor, "MATCH", pattern, "COUNT", 1000, "TYPE", "stream"))
            if keys:
                removed += yield Command(("UNLINK", *keys))
            if str(cursor) == "0":
                return removed

    def history(self, scope: str, limit: int) -> Plan[list[LeaseEvent]]:
        entries, state = yield ScriptCall(HISTORY, self._keys(scope).all, (limit,))
        events = _events(scope, list(reversed(entries)), state)
        return events[-limit:]


def _exhausted(scope: str, counter: str) -> TokenOverflow:
    return TokenOverflow(
        token=int(counter) if counter.isascii() and counter.isdigit() else counter,
        limit=MAX_TOKEN,
        scope=scope,
        detail="the coordinator's counter cannot issue another token",
    )


def _not_held(lease: Lease, current_token: int) -> LeaseLost:
    if current_token > lease.token:
        reason = f"superseded by token {current_token}"
    elif current_token < lease.token:
        reason = f"the coordinator's counter is at {current_token}, behind this lease (data loss?)"
    else:
        reason = "expired or released at the coordinator"
    lease.mark_lost(reason)
    return LeaseLost(scope=lease.scope, token=lease.token, lease_id=lease.lease_id, reason=reason)


def _events(scope: str, entries: list[str], state: list[str | None]) -> list[LeaseEvent]:
    """The scope's lease events, oldest first, from its history entries (oldest first) and its state.

    An epoch's release is read from the entry of the epoch after it (or, for the latest, from the
    state), where the acquire that followed wrote how and when the previous epoch ended."""
    events: list[LeaseEvent] = []
    holders: dict[int, tuple[str | None, str | None]] = {}  # token -> (holder, lease id)
    for raw in entries:
        entry = _entry(raw)
        if entry is None:
            # An entry no script of this package wrote (by hand, or by a version that let tokens
            # overflow): one unreadable entry must not hide the rest of the scope's history.
            log.warning("lease history of %r: skipped unreadable entry %r", scope, raw)
            continue
        event, token, at = entry["e"], entry["token"], entry["at"]
        previous = parse_token(entry.get("pt") or "") if entry.get("pt") else None
        previous_end = entry.get("pe") or None
        if event == "acquired" and previous is not None and previous_end == "released":
            ended_at = _millis(entry.get("pe_at"))
            holder, lease_id = holders.get(previous, (None, None))
            when = at if ended_at is None else ended_at
            events.append(LeaseEvent(scope, "released", previous, holder, lease_id, when))
        holders.setdefault(token, (entry.get("h") or None, entry.get("id") or None))
        events.append(
            LeaseEvent(
                scope=scope,
                event=event,
                token=token,
                holder=entry.get("h") or None,
                lease_id=entry.get("id") or None,
                at=at,
                previous_token=previous if event != "acquired" or previous_end else None,
                previous_end=previous_end if event == "acquired" else None,
                detail=entry.get("d") or None,
            )
        )
    current, end, ended_ms = [*state, None, None, None][:3]
    token = parse_token(current or "")
    ended_at = _millis(ended_ms)
    if token is not None and end == "released" and ended_at is not None and token in holders:
        # Right after the latest epoch's own entries: nothing of this package follows its release.
        after = max(i for i, event in enumerate(events) if event.token == token) + 1
        holder, lease_id = holders[token]
        events.insert(after, LeaseEvent(scope, "released", token, holder, lease_id, ended_at))
    return events


def _millis(value: object) -> float | None:
    return int(value) / 1000 if isinstance(value, str) and value.isdigit() else None


_FIELDS = ("e", "t", "at", "id", "h", "pt", "pe", "pe_at", "d")


def _entry(raw: str) -> dict[str, Any] | None:
    """A history entry by field name with its token and time parsed, or None when an entry's shape, event,
    token or time cannot be trusted."""
    fields = raw.split("\t")
    if len(fields) != len(_FIELDS):
        return None
    entry: dict[str, Any] = dict(zip(_FIELDS, fields, strict=True))
    token, at = parse_token(entry["t"]), _millis(entry["at"])
    if not entry["e"] or token is None or at is None:
        return None
    return {**entry, "token": token, "at": at}


# Where the keys live ------------------------------------------------------------------------------------

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
    """Where a lease URL puts the lease keys, read from the URL without connecting (:func:`redis_topology`).

    ``server``: one Redis server, ``redis://``, ``rediss://`` or ``unix://``, handed to redis-py as it is.
    ``sentinel``: ``redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]``. The
    sentinels at ``nodes`` name the primary of ``service``; the client asks them again whenever it has to
    connect, so it follows the primary through a failover.
    ``cluster``: ``redis+cluster://[[user]:password@]host:port[,host:port...]``. Any reachable node of
    ``nodes`` gives the slot map; every lease script touches one slot (:mod:`fencing.keys`), and the client
    sends it to the node serving that slot, following MOVED and ASK while slots move.

    A port left out is the scheme's usual one (26379 for sentinels, 6379 for cluster nodes). The user and
    password are the data nodes'. The sentinels are sent the same ones: a deployment that protects its
    data nodes gives its sentinels that password as their ``requirepass`` too (it is also what sentinels
    use with one another); sentinels without one would refuse it.
    """

    kind: str
    url: str
    nodes: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None

    @property
    def masked(self) -> str:
        """The URL as it may be printed, its password as ``***``."""
        if self.kind == "server":
            return mask_url(self.url)
        return _masked(self.url)

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
            f"not a usable Redis URL: {_masked(url)} ({exc}; use {_FORMS[scheme]})"
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


def _masked(url: str) -> str:
    """A Sentinel or Cluster URL with its password as ``***`` (mask_url reads one host per URL)."""
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    userinfo, at, hosts = authority.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    shown = f"{user}{colon}{'***' if colon else ''}{at}{hosts}"
    return f"{scheme}{sep}{shown}{slash}{path}"


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


# What Redis says "not now" with: the call did not run, and the same call can succeed once a failover, a
# resharding or a restart is over. redis-py raises a class of its own for the answers it knows, and the
# Sentinel and Cluster clients act on some before anyone sees them: a Sentinel client turns READONLY (a
# primary demoted under its connection) into a ConnectionError and asks the sentinels again; a Cluster
# client follows MOVED and ASK, waits out TRYAGAIN and CLUSTERDOWN, and raises only once it has run out of
# tries. LOADING (a node reading its data at start) is a ConnectionError of redis-py's.
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


def _unavailable(op: ScriptCall | Command, exc: Exception) -> BackendUnavailable:
    name = "command" if isinstance(op, Command) else "script"
    return BackendUnavailable(backend="redis", operation=name, detail=f"{type(exc).__name__}: {exc}")


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

    def _handle(self, op: Op) -> Any:
        if isinstance(op, Sleep):
            return self._sleep(op.seconds)
        if isinstance(op, Atomic):
            return self.run(op.plan)
        if not isinstance(op, ScriptCall | Command):
            raise foreign("Redis", op)
        try:
            if isinstance(op, ScriptCall):
                script = self._scripts.get(op.source)
                if script is None:
                    script = self._scripts[op.source] = self.client.register_script(op.source)
                return script(keys=op.keys, args=op.args)
            return self.client.execute_command(*op.args)  # type: ignore[no-untyped-call]
        except Exception as exc:
            if outage(exc):
                raise _unavailable(op, exc) from exc
            raise

    def close(self) -> None:
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
        if not isinstance(op, ScriptCall | Command):
            raise foreign("Redis", op)
        try:
            if isinstance(op, ScriptCall):
                script = self._scripts.get(op.source)
                if script is None:
                    script = self._scripts[op.source] = self.client.register_script(op.source)
                return await script(keys=op.keys, args=op.args)
            return await self.client.execute_command(*op.args)
        except Exception as exc:
            if outage(exc):
                raise _unavailable(op, exc) from exc
            raise

    async def close(self) -> None:
        await self.client.aclose()
        sentinels = _sentinels(self.client)
        if sentinels is not None:
            await sentinels.aclose()
