"""The Redis lease backend's Lua scripts, one per operation, each headed by its KEYS, ARGV and reply.

They run atomically in one round trip, and all keys of a scope share one hash tag, so one cluster slot.
"""

from __future__ import annotations

import enum


class Reply(enum.IntEnum):
    """First element of every script's reply that is a list. The replies of the calls a lease pair is
    made of, an acquisition and a release, are a bare integer instead (the token, whether the lease was
    contended): one less list to build, send and parse on the hot path."""

    OK = 0
    BUSY = 1
    NOT_HELD = 2
    OUT_OF_RANGE = 3  # a token past the largest one (MAX_TOKEN); nothing was written


# Tokens stay within MAX_TOKEN (2**53 - 1), where Lua's doubles are exact: comparisons, the integer
# replies and the decimal text Redis makes of a number passed to redis.call all keep every digit. Text
# the scripts make themselves goes through string.format('%d'), never tostring (14 digits).
#
# History is a short list per scope, newest first, one entry per epoch (written when it starts) and per
# administrative end (broken, repaired); it expires when the scope stays idle past the retention. An
# entry is its fields joined by tabs (holders and reasons are refused with control characters): event,
# token, at (ms), lease id, holder, previous token, previous end, when the previous epoch ended (ms),
# detail. How
# an epoch ended is written once, by whoever learns it: the release into the state hash (read back as the
# next entry's "pe"), an expiry by the next acquire. Renewals and releases add no entry: a scope costs
# its state hash plus at most ``cap`` short entries, not a growing log.

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
