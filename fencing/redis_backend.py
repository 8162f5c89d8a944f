"""Redis lease backend: every operation is one Lua script, one round trip, one cluster slot.

All keys of one scope share a hash tag, ``{prefix}:{<scope>}:...``, so they live in one Redis Cluster
slot and each script touches one slot; braces and ``%`` in a scope are percent-encoded so a scope can
never end the hash tag early. The token counter lives in a hash that never expires, apart from the lease
key that does, so an expired lease never resets the count.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from fencing.errors import InvalidLeaseRequest, LeaseBusy, LeaseLost, TokenOverflow
from fencing.lease import MAX_TOKEN, Clock, Lease, LeaseEvent, LeaseInfo, parse_token, ttl_ms, validate_token
from fencing.plan import Command, Plan, ScriptCall, ScriptCalls

log = logging.getLogger("fencing")

DEFAULT_PREFIX = "fencing"


def validate_prefix(prefix: object) -> str:
    if not isinstance(prefix, str) or not prefix.isprintable() or not prefix or set(prefix) & set("{}%"):
        raise InvalidLeaseRequest("key prefix must be non-empty, printable, without braces or '%'")
    return prefix


class ScopeKeys(NamedTuple):
    """The scripts' KEYS, in order. ``lease``: the live lease (value: lease id, expires with the ttl).
    ``state``: never expires; the token counter and the last epoch (lease id, holder, how and when it
    ended, whether an acquirer was turned away). ``log``: the scope's short history (below).
    (``:events`` held a capped stream in earlier versions; ``LeaseManager.purge_history`` removes those.)
    """

    lease: str
    state: str
    log: str


def scope_keys(prefix: str, scope: str) -> ScopeKeys:
    tag = scope.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    base = f"{prefix}:{{{tag}}}"
    return ScopeKeys(lease=f"{base}:lease", state=f"{base}:state", log=f"{base}:log")


class Reply(enum.IntEnum):
    """First element of every script's reply that is a list. The replies of the calls a lease pair is
    made of, an acquisition and a release, are a bare integer instead (the token, whether the lease was
    contended): one less list to build, send and parse on the hot path."""

    OK = 0
    BUSY = 1
    NOT_HELD = 2
    OUT_OF_RANGE = 3  # a token past the largest one (MAX_TOKEN); nothing was written


# The scripts, each headed by its KEYS, ARGV and reply. Tokens stay within MAX_TOKEN (2**53 - 1), where
# Lua's doubles are exact: comparisons, the integer replies and the decimal text Redis makes of a number
# passed to redis.call all keep every digit. Text the scripts make themselves goes through
# string.format('%d'), never tostring (14 digits).
#
# History is a short list per scope, newest first, one entry per epoch (written when it starts) and per
# administrative end (broken, repaired); it expires when the scope stays idle past the retention. An
# entry is its fields joined by tabs (holders and reasons are refused with control characters): event,
# token, at (ms), lease id, holder, previous token, previous end, when the previous epoch ended (ms),
# detail. How an epoch ended is written once, by whoever learns it: the release into the state hash
# (read back as the next entry's "pe"), an expiry by the next acquire. Renewals and releases add no
# entry: a scope costs its state hash plus at most ``cap`` short entries, not a growing log.

# KEYS[1] lease, KEYS[2] state, KEYS[3] log
# ARGV[1] lease id, ARGV[2] holder, ARGV[3] ttl in ms, ARGV[4] history cap, ARGV[5] largest token,
# ARGV[6] history retention in ms
# returns token (a bare integer: acquired) | {BUSY, holder, token, pttl_ms} | {OUT_OF_RANGE, counter as
# stored}
# A busy reply also marks the live lease contended, which its release reports. The counter is read,
# checked and written back one higher by this script alone (scripts run one at a time), so one HSET
# writes the token with the rest of the epoch's state.
ACQUIRE = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[3]) then
  local s = redis.call('HMGET', KEYS[2], 'holder', 'token')
  local counter = s[2] or '0'
  if not string.find(counter, '^%d+$') or tonumber(counter) >= tonumber(ARGV[5]) then
    return {3, counter}
  end
  redis.call('HSET', KEYS[2], 'contended', '1')
  return {1, s[1] or '', tonumber(counter), redis.call('PTTL', KEYS[1])}
end
local prev = redis.call('HMGET', KEYS[2], 'token', 'end', 'ended_ms')
local counter = prev[1] or '0'
if not string.find(counter, '^%d+$') or tonumber(counter) >= tonumber(ARGV[5]) then
  redis.call('DEL', KEYS[1])
  return {3, counter}
end
local prev_end, prev_at = prev[2] or '', prev[3] or ''
if prev_end == 'held' then prev_end, prev_at = 'expired', '' end
local now = redis.call('TIME')
local token = tonumber(counter) + 1
local text = string.format('%d', token)
redis.call('HSET', KEYS[2], 'token', text, 'lease_id', ARGV[1], 'holder', ARGV[2], 'end', 'held',
  'contended', '0')
local length = redis.call('LPUSH', KEYS[3], table.concat({'acquired', text,
  string.format('%d', now[1] * 1000 + math.floor(now[2] / 1000)), ARGV[1], ARGV[2], prev[1] or '',
  prev_end, prev_at, 'ttl_ms=' .. ARGV[3]}, '\t'))
if length > tonumber(ARGV[4]) then redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[4]) - 1) end
redis.call('PEXPIRE', KEYS[3], ARGV[6])
return token
"""

# KEYS[1] lease, KEYS[2] state
# ARGV[1] lease id, ARGV[2] ttl in ms
# returns {OK, token} | {NOT_HELD, current token or 0}
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {0, tonumber(redis.call('HGET', KEYS[2], 'token'))}
end
return {2, tonumber(redis.call('HGET', KEYS[2], 'token')) or 0}
"""

# KEYS[1] lease, KEYS[2] state
# ARGV[1] lease id
# returns contended (a bare integer, 1 or 0: released) | {NOT_HELD, current token or 0}
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  local now = redis.call('TIME')
  local contended = redis.call('HGET', KEYS[2], 'contended')
  redis.call('HSET', KEYS[2], 'end', 'released',
    'ended_ms', string.format('%d', now[1] * 1000 + math.floor(now[2] / 1000)))
  -- Who held it is in the log; only a live lease needs it here (busy replies, breaks, repairs).
  redis.call('HDEL', KEYS[2], 'lease_id', 'holder')
  return contended == '0' and 0 or 1
end
return {2, tonumber(redis.call('HGET', KEYS[2], 'token')) or 0}
"""

# Administrative: end whatever lease is current, without knowing its id (the token is kept, so the
# next owner still gets a higher one). KEYS as ACQUIRE; ARGV[1] reason, ARGV[2] history cap,
# ARGV[3] history retention in ms.
# returns {OK, token, holder} | {NOT_HELD}
BREAK = """
local id = redis.call('GET', KEYS[1])
if not id then return {2} end
redis.call('DEL', KEYS[1])
local now = redis.call('TIME')
local at = string.format('%d', now[1] * 1000 + math.floor(now[2] / 1000))
redis.call('HSET', KEYS[2], 'end', 'broken', 'ended_ms', at)
local s = redis.call('HMGET', KEYS[2], 'token', 'holder')
redis.call('LPUSH', KEYS[3], table.concat({'broken', s[1], at, id, s[2] or '', '', '', '', ARGV[1]}, '\t'))
redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[2]) - 1)
redis.call('PEXPIRE', KEYS[3], ARGV[3])
return {0, tonumber(s[1]), s[2] or ''}
"""

# Raise a counter that went backwards (data loss, failover to a lagging replica) past the highest token
# the resource accepted. Only the *current* holder may trigger it: its rejection proves the counter,
# not the holder, is behind. Its epoch ends too, since its token can never write.
# KEYS as ACQUIRE; ARGV[1] lease id, ARGV[2] highest accepted token, ARGV[3] history cap, ARGV[4] largest
# token, ARGV[5] history retention in ms
# returns {OK, old counter, new counter} | {NOT_HELD} | {OUT_OF_RANGE}
REPAIR = """
if not string.find(ARGV[2], '^%d+$') or tonumber(ARGV[2]) > tonumber(ARGV[4]) then return {3} end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {2} end
local old = tonumber(redis.call('HGET', KEYS[2], 'token')) or 0
local new = old
if old < tonumber(ARGV[2]) then
  new = tonumber(ARGV[2])
  redis.call('HSET', KEYS[2], 'token', ARGV[2])
end
redis.call('DEL', KEYS[1])
local now = redis.call('TIME')
local at = string.format('%d', now[1] * 1000 + math.floor(now[2] / 1000))
redis.call('HSET', KEYS[2], 'end', 'broken', 'ended_ms', at)
redis.call('LPUSH', KEYS[3], table.concat({'repaired', string.format('%d', new), at, ARGV[1],
  redis.call('HGET', KEYS[2], 'holder') or '', string.format('%d', old), '', '',
  'counter raised past the resource\\'s highest token ' .. ARGV[2]}, '\t'))
redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[3]) - 1)
redis.call('PEXPIRE', KEYS[3], ARGV[5])
return {0, old, new}
"""

# KEYS as ACQUIRE. returns {token, holder, pttl_ms} of the live lease, or {} when the scope is free.
CURRENT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
local s = redis.call('HMGET', KEYS[2], 'token', 'holder')
return {tonumber(s[1]) or 0, s[2] or '', redis.call('PTTL', KEYS[1])}
"""

# KEYS as ACQUIRE; ARGV[1] how many entries. returns {entries newest first, {token, end, ended_ms}}
HISTORY = """
return {redis.call('LRANGE', KEYS[3], 0, tonumber(ARGV[1]) - 1),
  redis.call('HMGET', KEYS[2], 'token', 'end', 'ended_ms')}
"""


@dataclass(frozen=True, slots=True)
class RedisLeaseCore:
    """Decisions and parsing for the Redis backend; no I/O."""

    backend: ClassVar[str] = "redis"

    prefix: str
    history_cap: int
    history_retention_ms: int
    clock: Clock
    cluster: bool = False  # the keys are spread over a Redis Cluster's nodes

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
