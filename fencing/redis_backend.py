"""Redis lease backend: every operation is one Lua script, one round trip, one cluster slot.

The token counter lives in a hash that never expires, apart from the lease key that does, so an expired
lease never resets the count. History is appended to a capped stream inside the same script.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

from fencing.errors import BackendUnavailable, LeaseBusy, LeaseLost, TokenOverflow
from fencing.keys import ScopeKeys, scope_keys
from fencing.lease import MAX_TOKEN, Clock, Lease, LeaseEvent, LeaseInfo, parse_token, validate_token
from fencing.plan import Atomic, Plan, Sleep, run_async, run_sync


class Reply(enum.IntEnum):
    """First element of every script's reply."""

    OK = 0
    BUSY = 1
    NOT_HELD = 2
    OUT_OF_RANGE = 3  # a token past the largest one (MAX_TOKEN); nothing was written


log = logging.getLogger("fencing")

# Tokens stay within MAX_TOKEN (2**53 - 1), where Lua's doubles are exact: comparisons, the integer
# replies and the decimal text Redis makes of a number passed to redis.call all keep every digit.

# KEYS[1] lease, KEYS[2] state, KEYS[3] events
# ARGV[1] lease id, ARGV[2] holder, ARGV[3] ttl in ms, ARGV[4] history cap, ARGV[5] largest token
# returns {OK, token} | {BUSY, holder, token, pttl_ms} | {OUT_OF_RANGE, counter as stored}
# A busy reply also marks the live lease contended, which its release reports.
ACQUIRE = """
local prev = redis.call('HMGET', KEYS[2], 'token', 'end')
local counter = prev[1] or '0'
if not string.find(counter, '^%d+$') or tonumber(counter) >= tonumber(ARGV[5]) then
  return {3, counter}
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[2], 'contended', '1')
  local s = redis.call('HMGET', KEYS[2], 'holder', 'token')
  return {1, s[1] or '', tonumber(s[2]) or 0, redis.call('PTTL', KEYS[1])}
end
local prev_end = prev[2] or ''
if prev_end == 'held' then prev_end = 'expired' end
local token = redis.call('HINCRBY', KEYS[2], 'token', 1)
redis.call('HSET', KEYS[2], 'lease_id', ARGV[1], 'holder', ARGV[2], 'end', 'held', 'contended', '0')
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'event', 'acquired', 'token', token,
  'lease_id', ARGV[1], 'holder', ARGV[2], 'previous_token', prev[1] or '', 'previous_end', prev_end,
  'detail', 'ttl_ms=' .. ARGV[3])
return {0, token}
"""

# KEYS[1] lease, KEYS[2] state, KEYS[3] events
# ARGV[1] lease id, ARGV[2] ttl in ms, ARGV[3] history cap
# returns {OK, token} | {NOT_HELD, current token or 0}
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  local s = redis.call('HMGET', KEYS[2], 'token', 'holder')
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'event', 'renewed', 'token', s[1],
    'lease_id', ARGV[1], 'holder', s[2] or '', 'detail', 'ttl_ms=' .. ARGV[2])
  return {0, tonumber(s[1])}
end
return {2, tonumber(redis.call('HGET', KEYS[2], 'token')) or 0}
"""

# KEYS[1] lease, KEYS[2] state, KEYS[3] events
# ARGV[1] lease id, ARGV[2] history cap
# returns {OK, token, contended (1 or 0)} | {NOT_HELD, current token or 0}
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[2], 'end', 'released')
  local s = redis.call('HMGET', KEYS[2], 'token', 'holder', 'contended')
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*', 'event', 'released', 'token', s[1],
    'lease_id', ARGV[1], 'holder', s[2] or '')
  return {0, tonumber(s[1]), s[3] == '0' and 0 or 1}
end
return {2, tonumber(redis.call('HGET', KEYS[2], 'token')) or 0}
"""

# Administrative: end whatever lease is current, without knowing its id (the token is kept, so the
# next owner still gets a higher one). KEYS as above; ARGV[1] reason, ARGV[2] history cap.
# returns {OK, token, holder} | {NOT_HELD}
BREAK = """
local id = redis.call('GET', KEYS[1])
if not id then return {2} end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[2], 'end', 'broken')
local s = redis.call('HMGET', KEYS[2], 'token', 'holder')
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*', 'event', 'broken', 'token', s[1],
  'lease_id', id, 'holder', s[2] or '', 'detail', ARGV[1])
return {0, tonumber(s[1]), s[2] or ''}
"""

# Raise a counter that went backwards (data loss, failover to a lagging replica) past the highest token
# the resource accepted. Only the *current* holder may trigger it: its rejection proves the counter,
# not the holder, is behind. Its epoch ends too, since its token can never write.
# KEYS as above; ARGV[1] lease id, ARGV[2] highest accepted token, ARGV[3] history cap, ARGV[4] largest token
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
redis.call('HSET', KEYS[2], 'end', 'broken')
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'event', 'repaired', 'token', new,
  'lease_id', ARGV[1], 'holder', redis.call('HGET', KEYS[2], 'holder') or '',
  'previous_token', old, 'detail', 'counter raised past the resource\\'s highest token ' .. ARGV[2])
return {0, old, new}
"""

# KEYS as above. returns {token, holder, pttl_ms} of the live lease, or {} when the scope is free.
CURRENT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
local s = redis.call('HMGET', KEYS[2], 'token', 'holder')
return {tonumber(s[1]) or 0, s[2] or '', redis.call('PTTL', KEYS[1])}
"""


@dataclass(frozen=True, slots=True)
class ScriptCall:
    source: str
    keys: tuple[str, ...]
    args: tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Command:
    args: tuple[str | int, ...]


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


class RedisLeaseCore:
    """Decisions and parsing for the Redis backend; no I/O."""

    backend = "redis"

    def __init__(self, *, prefix: str, history_cap: int, clock: Clock) -> None:
        self.prefix = prefix
        self.history_cap = history_cap
        self.clock = clock

    def _keys(self, scope: str) -> ScopeKeys:
        return scope_keys(self.prefix, scope)

    def acquire(self, scope: str, ttl: float, holder: str, lease_id: str) -> Plan[Lease | LeaseBusy]:
        sent_at = self.clock()
        reply = yield ScriptCall(
            ACQUIRE, self._keys(scope).all, (lease_id, holder, _ms(ttl), self.history_cap, MAX_TOKEN)
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
        reply = yield ScriptCall(
            RENEW, self._keys(lease.scope).all, (lease.lease_id, _ms(lease.ttl), self.history_cap)
        )
        if int(reply[0]) != Reply.OK or int(reply[1]) != lease.token:
            raise _not_held(lease, int(reply[1]))
        lease._renewed(sent_at)
        return lease

    def release(self, lease: Lease) -> Plan[bool]:
        reply = yield ScriptCall(RELEASE, self._keys(lease.scope).all, (lease.lease_id, self.history_cap))
        if int(reply[0]) != Reply.OK:
            raise _not_held(lease, int(reply[1]))
        return bool(int(reply[2]))

    def break_lease(self, scope: str, reason: str) -> Plan[LeaseInfo | None]:
        reply = yield ScriptCall(BREAK, self._keys(scope).all, (reason, self.history_cap))
        if int(reply[0]) != Reply.OK:
            return None
        return LeaseInfo(scope=scope, token=int(reply[1]), holder=reply[2], time_left=0.0)

    def repair(self, lease: Lease, highest: int) -> Plan[tuple[int, int] | None]:
        validate_token(highest, scope=lease.scope)
        reply = yield ScriptCall(
            REPAIR, self._keys(lease.scope).all, (lease.lease_id, highest, self.history_cap, MAX_TOKEN)
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
        """Nothing to do: each scope's stream is capped at ``history_cap`` entries by the scripts."""
        return 0
        yield  # pragma: no cover - makes this a plan like the others

    def history(self, scope: str, limit: int) -> Plan[list[LeaseEvent]]:
        entries = yield Command(("XREVRANGE", self._keys(scope).events, "+", "-", "COUNT", limit))
        events = []
        for entry_id, fields in reversed(entries):
            event = _event(scope, entry_id, fields)
            if event is None:
                # An entry no script of this package wrote (by hand, or by a version that let tokens
                # overflow): one unreadable entry must not hide the rest of the scope's history.
                log.warning("lease history of %r: skipped unreadable entry %s %r", scope, entry_id, fields)
            else:
                events.append(event)
        return events


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


def _event(scope: str, entry_id: str, fields: dict[str, str]) -> LeaseEvent | None:
    """The stream entry as an event, or None when its event name, token or id cannot be trusted."""
    token = parse_token(fields.get("token") or "0")
    event = fields.get("event")
    millis = entry_id.split("-", 1)[0]
    if token is None or not event or not millis.isdigit():
        return None
    previous = fields.get("previous_token") or ""
    return LeaseEvent(
        scope=scope,
        event=event,
        token=token,
        holder=fields.get("holder") or None,
        lease_id=fields.get("lease_id") or None,
        at=int(millis) / 1000,
        # An unreadable previous token only loses that detail, not the event.
        previous_token=parse_token(previous) if previous else None,
        previous_end=fields.get("previous_end") or None,
        detail=fields.get("detail") or None,
    )


# Error replies (out of memory, MISCONF, BUSY script, read-only replica) mean Redis cannot serve the
# operation now; none of them can be a partial lease change, since each script is atomic.
_UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError, redis.ResponseError)


def _unavailable(op: object, exc: redis.RedisError) -> BackendUnavailable:
    name = "command" if isinstance(op, Command) else "script"
    return BackendUnavailable(backend="redis", operation=name, detail=f"{type(exc).__name__}: {exc}")


class SyncRedisExecutor:
    """Runs plans on a ``redis.Redis`` client; scripts registered once per client."""

    def __init__(self, client: redis.Redis, sleep: Callable[[float], None]) -> None:
        self.client = client
        self._sleep = sleep
        self._scripts: dict[str, Any] = {}

    def run(self, plan: Plan[Any]) -> Any:
        return run_sync(plan, self._handle)

    def _handle(self, op: object) -> Any:
        if isinstance(op, Sleep):
            return self._sleep(op.seconds)
        if isinstance(op, Atomic):
            return self.run(op.plan)
        try:
            if isinstance(op, ScriptCall):
                script = self._scripts.get(op.source)
                if script is None:
                    script = self._scripts[op.source] = self.client.register_script(op.source)
                return script(keys=op.keys, args=op.args)
            assert isinstance(op, Command)
            return self.client.execute_command(*op.args)  # type: ignore[no-untyped-call]
        except _UNAVAILABLE as exc:
            raise _unavailable(op, exc) from exc

    def close(self) -> None:
        self.client.close()


class AsyncRedisExecutor:
    """The async shell of :class:`SyncRedisExecutor` over ``redis.asyncio.Redis``."""

    def __init__(self, client: redis.asyncio.Redis, sleep: Callable[[float], Any]) -> None:
        self.client = client
        self._sleep = sleep
        self._scripts: dict[str, Any] = {}

    async def run(self, plan: Plan[Any]) -> Any:
        return await run_async(plan, self._handle)

    async def _handle(self, op: object) -> Any:
        if isinstance(op, Sleep):
            return await self._sleep(op.seconds)
        if isinstance(op, Atomic):
            return await self.run(op.plan)
        try:
            if isinstance(op, ScriptCall):
                script = self._scripts.get(op.source)
                if script is None:
                    script = self._scripts[op.source] = self.client.register_script(op.source)
                return await script(keys=op.keys, args=op.args)
            assert isinstance(op, Command)
            return await self.client.execute_command(*op.args)  # type: ignore[no-untyped-call]
        except _UNAVAILABLE as exc:
            raise _unavailable(op, exc) from exc

    async def close(self) -> None:
        await self.client.aclose()
