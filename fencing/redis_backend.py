"""Redis lease backend: every operation is one Lua script, one round trip, one cluster slot.

The token counter lives in a hash that never expires, apart from the lease key that does, so an expired
lease never resets the count. History is a short list per scope written by the same scripts, one entry
per epoch, expiring with the scope's idleness (see the scripts' comment).
"""

from __future__ import annotations

import logging
from typing import Any

from fencing.errors import LeaseBusy, LeaseLost, TokenOverflow
from fencing.keys import ScopeKeys, scope_keys
from fencing.lease import MAX_TOKEN, Clock, Lease, LeaseEvent, LeaseInfo, parse_token, ttl_ms, validate_token
from fencing.plan import Command, Plan, ScriptCall, ScriptCalls
from fencing.redis_scripts import ACQUIRE, BREAK, CURRENT, HISTORY, RELEASE, RENEW, REPAIR, Reply

log = logging.getLogger("fencing")


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
            self._keys(scope),
            (lease_id, holder, ttl_ms(ttl), self.history_cap, MAX_TOKEN, self.history_retention_ms),
        )
        if isinstance(reply, int):
            return Lease(scope, reply, lease_id, holder, ttl, sent_at, clock=self.clock)
        if int(reply[0]) == Reply.OUT_OF_RANGE:
            raise TokenOverflow.exhausted(scope, reply[1], MAX_TOKEN)
        return LeaseBusy(
            scope=scope,
            holder=reply[1] or None,
            token=int(reply[2]) or None,
            retry_after=max(int(reply[3]), 0) / 1000,
        )

    def renew(self, lease: Lease) -> Plan[Lease]:
        sent_at = self.clock()
        keys = self._keys(lease.scope)
        reply = yield ScriptCall(RENEW, (keys.lease, keys.state), (lease.lease_id, ttl_ms(lease.ttl)))
        if int(reply[0]) != Reply.OK or int(reply[1]) != lease.token:
            raise _not_held(lease, int(reply[1]))
        lease._renewed(sent_at)
        return lease

    def release(self, lease: Lease) -> Plan[bool]:
        keys = self._keys(lease.scope)
        reply = yield ScriptCall(RELEASE, (keys.lease, keys.state), (lease.lease_id,))
        if isinstance(reply, int):
            return bool(reply)
        raise _not_held(lease, int(reply[1]))

    def break_lease(self, scope: str, reason: str) -> Plan[LeaseInfo | None]:
        reply = yield ScriptCall(
            BREAK, self._keys(scope), (reason, self.history_cap, self.history_retention_ms)
        )
        if int(reply[0]) != Reply.OK:
            return None
        return LeaseInfo(scope=scope, token=int(reply[1]), holder=reply[2], time_left=0.0)

    def repair(self, lease: Lease, highest: int) -> Plan[tuple[int, int] | None]:
        validate_token(highest, scope=lease.scope)
        reply = yield ScriptCall(
            REPAIR,
            self._keys(lease.scope),
            (lease.lease_id, highest, self.history_cap, MAX_TOKEN, self.history_retention_ms),
        )
        if int(reply[0]) == Reply.OUT_OF_RANGE:
            raise TokenOverflow(token=highest, limit=MAX_TOKEN, scope=lease.scope)
        if int(reply[0]) != Reply.OK:
            return None
        return int(reply[1]), int(reply[2])

    def current_many(self, scopes: list[str]) -> Plan[list[LeaseInfo | None]]:
        replies = yield ScriptCalls(CURRENT, tuple((self._keys(scope), ()) for scope in scopes))
        return [
            LeaseInfo(scope=scope, token=int(r[0]), holder=r[1], time_left=max(int(r[2]), 0) / 1000)
            if r
            else None
            for scope, r in zip(scopes, replies, strict=True)
        ]

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
        entries, state = yield ScriptCall(HISTORY, self._keys(scope), (limit,))
        events = _events(scope, list(reversed(entries)), state)
        return events[-limit:]


def _not_held(lease: Lease, current_token: int) -> LeaseLost:
    if current_token > lease.token:
        reason = f"superseded by token {current_token}"
    elif current_token < lease.token:
        reason = f"the coordinator's counter is at {current_token}, behind this lease (data loss?)"
    else:
        reason = "expired or released at the coordinator"
    return lease.lose(reason)


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
