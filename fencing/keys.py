"""Redis key layout of the fencing package, in one place.

All keys of one scope share a hash tag, ``{prefix}:{<scope>}:...``, so they live in one Redis Cluster
slot and each Lua script touches one slot. Braces and ``%`` in a scope are percent-encoded so a scope can
never end the hash tag early.
"""

from __future__ import annotations

from typing import NamedTuple

from fencing.errors import InvalidLeaseRequest

DEFAULT_PREFIX = "fencing"


def validate_prefix(prefix: object) -> str:
    if not isinstance(prefix, str) or not prefix.isprintable() or not prefix or set(prefix) & set("{}%"):
        raise InvalidLeaseRequest("key prefix must be non-empty, printable, without braces or '%'")
    return prefix


class ScopeKeys(NamedTuple):
    """The scripts' KEYS, in order. ``lease``: the live lease (value: lease id, expires with the ttl).
    ``state``: never expires; the token counter and the last epoch (lease id, holder, how and when it
    ended, whether an acquirer was turned away).
    ``log``: a short list of the last epochs, newest first, written by the scripts that start or break
    them; it expires when the scope stays idle. (``:events`` held a capped stream in earlier versions;
    ``LeaseManager.purge_history`` removes those.)
    """

    lease: str
    state: str
    log: str


def scope_keys(prefix: str, scope: str) -> ScopeKeys:
    tag = scope.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    base = f"{prefix}:{{{tag}}}"
    return ScopeKeys(lease=f"{base}:lease", state=f"{base}:state", log=f"{base}:log")
