"""Redis key layout of the fencing package, in one place.

All keys of one scope share a hash tag, ``{prefix}:{<scope>}:...``, so they live in one Redis Cluster
slot and each Lua script touches one slot. Braces and ``%`` in a scope are percent-encoded so a scope can
never end the hash tag early.
"""

from __future__ import annotations

from dataclasses import dataclass

from fencing.errors import InvalidLeaseRequest

DEFAULT_PREFIX = "fencing"


def validate_prefix(prefix: object) -> str:
    if not isinstance(prefix, str) or not prefix.isprintable() or not prefix or set(prefix) & set("{}%"):
        raise InvalidLeaseRequest("key prefix must be non-empty, printable, without braces or '%'")
    return prefix


def scope_tag(scope: str) -> str:
    return scope.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


@dataclass(frozen=True, slots=True)
class ScopeKeys:
    """``lease``: the live lease (value: lease id, expires with the ttl).
    ``state``: never expires; the token counter and the last epoch (lease id, holder, how it ended).
    ``events``: capped stream of lease events, appended by the same script that changes the lease.
    """

    lease: str
    state: str
    events: str

    @property
    def all(self) -> tuple[str, str, str]:
        return (self.lease, self.state, self.events)


def scope_keys(prefix: str, scope: str) -> ScopeKeys:
    base = f"{prefix}:{{{scope_tag(scope)}}}"
    return ScopeKeys(lease=f"{base}:lease", state=f"{base}:state", events=f"{base}:events")
