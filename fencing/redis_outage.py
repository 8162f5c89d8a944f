"""Which errors of a redis-py client are an outage: Redis could not serve the call now, and the same call
can succeed later. Those reach callers as :class:`BackendUnavailable`, like a lost connection; any other
error Redis answers is a refusal and stays redis-py's."""

from __future__ import annotations

import redis
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

from fencing.errors import BackendUnavailable
from fencing.plan import Command, ScriptCall, ScriptCalls

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


def unavailable(op: ScriptCall | ScriptCalls | Command, exc: Exception) -> BackendUnavailable:
    """What callers hear of ``op`` meeting an outage: the error names the call's kind and the cause."""
    name = "command" if isinstance(op, Command) else "script"
    return BackendUnavailable(backend="redis", operation=name, detail=f"{type(exc).__name__}: {exc}")
