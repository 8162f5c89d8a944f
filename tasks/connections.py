"""How a worker's clients connect to the database and the lease backend: the options every client of the
worker is built with, derived from the lease ttl (the checks at start use the same)."""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

# A thread pool runs many tasks in one process on these clients: let the connection pool grow with it
# (connections open only when needed) instead of queueing tasks on five connections.
SQL_POOL: dict[str, Any] = {"pool_size": 5, "max_overflow": 64}


def client_options(url: str, lease_ttl: float, pooling: str = "session") -> dict[str, Any]:
    """The options a worker builds its client for ``url`` with (Redis or SQL); ``pooling``: the SQL
    engine's (``RESERVATIONS_DATABASE_POOLING``)."""
    if url.startswith(("redis", "rediss", "unix")):
        # A lease call that has not answered within a third of the ttl is of no use (a renewal would come
        # too late): give up then, as unavailable, instead of waiting on TCP for minutes when the worker is
        # cut off from Redis.
        wait = max(0.5, min(5.0, lease_ttl / 3))
        # One reconnect for a pooled connection the server closed, none with backoff: redis-py's default
        # retries a refused connection ten times with growing pauses, which a sentinel client pays per
        # sentinel, seconds in all, before the call says the primary is unreachable.
        retry = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
        return {"socket_timeout": wait, "socket_connect_timeout": wait, "retry": retry}
    in_memory = url.startswith("sqlite") and (":memory:" in url or url.rstrip("/") == "sqlite:")
    return {} if in_memory else {**SQL_POOL, "pooling": pooling}
