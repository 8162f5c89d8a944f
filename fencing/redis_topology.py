"""Where a lease URL puts the lease keys: one Redis server, a primary found through Redis Sentinel, or a
Redis Cluster, read from the URL without connecting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis

from fencing.errors import InvalidLeaseRequest
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
