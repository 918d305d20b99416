"""The Lua scripts of the Redis store: one script per operation, run atomically by Redis.

Every decision reads and writes inside one script, so replicas cannot interleave a read
and a write (the way rate limits become ``limit x replicas``). Time is Redis's own
``TIME``, so the replicas' clocks never need to agree. Numbers cross the boundary as
strings (``%.17g``): Redis truncates a Lua number returned to the client to an integer.

Key layout under a prefix ``P`` (default ``tokenpace:``):
- ``P b:<tenant>:<budget>`` hash {l: level, t: time of level}; expires when full again
  (an absent bucket is full, so nothing idle stays in Redis).
- ``P s:<slot key>`` sorted set lease id -> expiry in ms; expired members are purged
  whenever the set is counted, and the set itself expires after twice the lease time.
- ``P v:<lane>`` hash tenant -> virtual counter.
- ``P d:<lane>`` hash second -> cost dispatched in that second (lane shares).
"""

from __future__ import annotations

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function num(x) return string.format('%.17g', x) end
"""

# Budget level after refill (absent bucket: full).
_LEVEL = """
local function level_of(key, tokens, rate)
  local v = redis.call('HMGET', key, 'l', 't')
  if not v[1] then return tokens end
  return math.min(tokens, tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * rate)
end
local function store(key, level, tokens, rate)
  if level >= tokens then redis.call('DEL', key) return end
  redis.call('HSET', key, 'l', num(level), 't', num(now))
  redis.call('PEXPIRE', key, math.ceil((tokens - level) / rate * 1000) + 1000)
end
"""

# KEYS: one bucket per budget. ARGV: cost, then tokens and refill/s per budget.
# Returns {0} when reserved, else {index, wait_s, remaining, reset_s} of the budget with the
# longest wait (wait "inf": the cost exceeds the whole budget).
RESERVE = _NOW + _LEVEL + """
local cost = tonumber(ARGV[1])
local levels = {}
local worst, worst_wait = 0, 0
for i = 1, #KEYS do
  local tokens, rate = tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1])
  local level = level_of(KEYS[i], tokens, rate)
  levels[i] = level
  local wait = 0
  if cost > tokens then wait = math.huge
  elseif cost > level then wait = (cost - level) / rate end
  if wait > worst_wait then worst, worst_wait = i, wait end
end
if worst > 0 then
  local tokens, rate = tonumber(ARGV[2 * worst]), tonumber(ARGV[2 * worst + 1])
  local wait = 'inf'
  if worst_wait ~= math.huge then wait = num(worst_wait) end
  return {worst, wait, num(math.max(0, levels[worst])),
          num(math.max(0, tokens - levels[worst]) / rate)}
end
for i = 1, #KEYS do
  store(KEYS[i], levels[i] - cost, tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1]))
end
return {0}
"""

# KEYS: buckets. ARGV: delta (reserved - actual), then tokens and refill/s per budget.
SETTLE = _NOW + _LEVEL + """
local delta = tonumber(ARGV[1])
for i = 1, #KEYS do
  local tokens, rate = tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1])
  store(KEYS[i], math.min(tokens, level_of(KEYS[i], tokens, rate) + delta), tokens, rate)
end
return 0
"""

# KEYS: buckets. ARGV: tokens and refill/s per budget. Returns the levels.
LEVELS = _NOW + _LEVEL + """
local out = {}
for i = 1, #KEYS do
  out[i] = num(level_of(KEYS[i], tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])))
end
return out
"""

# KEYS: n claimed slot sets, then the slot sets of the lease being given back.
# ARGV: lease id, lease ms, n, n limits (-1: none), id of the lease given back ('' if none).
# Returns {0} when every slot was taken, else {index, held} of the first full one.
ACQUIRE = _NOW + """
local id, ttl, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 1, n do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now_ms)
  local limit = tonumber(ARGV[3 + i])
  if limit >= 0 then
    local held = redis.call('ZCARD', KEYS[i])
    if held >= limit then return {i, held} end
  end
end
for i = 1, n do
  redis.call('ZADD', KEYS[i], now_ms + ttl, id)
  redis.call('PEXPIRE', KEYS[i], 2 * ttl)
end
local old = ARGV[4 + n]
for i = n + 1, #KEYS do redis.call('ZREM', KEYS[i], old) end
return {0}
"""

# KEYS: slot sets. ARGV: lease ms, then the lease id held in each set.
# Re-adds a lease Redis lost (restarted without its data, or expired while the holder was
# slow): the request still runs, so it still occupies its slot. Returns how many were re-added.
RENEW = _NOW + """
local ttl, lost = tonumber(ARGV[1]), 0
for i = 1, #KEYS do
  lost = lost + redis.call('ZADD', KEYS[i], now_ms + ttl, ARGV[1 + i])
  redis.call('PEXPIRE', KEYS[i], 2 * ttl)
end
return lost
"""

# KEYS: slot sets. ARGV: lease id. Returns nothing.
RELEASE = """
for i = 1, #KEYS do redis.call('ZREM', KEYS[i], ARGV[1]) end
return 0
"""

# KEYS: slot sets. Returns live members per set.
HELD = _NOW + """
local out = {}
for i = 1, #KEYS do out[i] = redis.call('ZCOUNT', KEYS[i], '(' .. now_ms, '+inf') end
return out
"""

# KEYS: counters hash, then the queued slot set of every other tenant of the lane.
# ARGV: tenant, then the other tenants. Returns the tenant's counter after the lift.
LIFT = _NOW + """
local tenant = ARGV[1]
local floor, largest = nil, nil
for i = 2, #KEYS do
  local c = redis.call('HGET', KEYS[1], ARGV[i])
  if c then
    c = tonumber(c)
    if largest == nil or c > largest then largest = c end
  else
    c = 0
  end
  if redis.call('ZCOUNT', KEYS[i], '(' .. now_ms, '+inf') > 0 then
    if floor == nil or c < floor then floor = c end
  end
end
if floor == nil then floor = largest end
local current = tonumber(redis.call('HGET', KEYS[1], tenant) or '0')
if floor ~= nil and floor > current then
  current = floor
  redis.call('HSET', KEYS[1], tenant, num(current))
end
return num(current)
"""

# KEYS: one dispatch hash per lane. ARGV: window s, then a cost per lane (or nothing to only
# read). Adds the costs to this second's field, drops fields older than the window and
# returns each lane's total over the window.
LANES = _NOW + """
local window = tonumber(ARGV[1])
local second = math.floor(now)
local out = {}
for i = 1, #KEYS do
  local cost = ARGV[1 + i]
  if cost and tonumber(cost) > 0 then
    redis.call('HINCRBYFLOAT', KEYS[i], second, cost)
    redis.call('EXPIRE', KEYS[i], math.ceil(window) + 2)
  end
  local total = 0
  local fields = redis.call('HGETALL', KEYS[i])
  for j = 1, #fields, 2 do
    if tonumber(fields[j]) <= second - window then redis.call('HDEL', KEYS[i], fields[j])
    else total = total + tonumber(fields[j + 1]) end
  end
  out[i] = num(total)
end
return out
"""
