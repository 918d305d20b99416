"""The Lua scripts of the Redis store: one script per operation, run atomically by Redis.

Every decision reads and writes inside one script, so replicas cannot interleave a read
and a write (the way rate limits become ``limit x replicas``). Time is Redis's own
``TIME``, so the replicas' clocks never need to agree. Numbers cross the boundary as
strings (``%.17g``): Redis truncates a Lua number returned to the client to an integer.

Key layout under a prefix ``P`` (default ``tokenpace:``):
- ``P b:<tenant>:<budget>`` hash {l: level, t: time of level}; expires when full again
  (an absent bucket is full, so nothing idle stays in Redis). A calendar budget's key
  ends with its period's start (``...:2000000/month@1798761600``), computed by the
  replica from its wall clock, and never refills: it expires an hour after its period
  ends (a replica whose clock lags a little still finds it).

A budget crosses the boundary as three numbers: tokens, refill per second (0: calendar),
seconds until its period ends (-1: a sliding budget).
- ``P s:<slot key>`` sorted set lease id -> expiry in ms; expired members are purged
  whenever the set is counted, and the set itself expires after twice the lease time.
- ``P v:<lane>`` hash tenant -> virtual counter; ``P m:<lane>`` the largest of them;
  ``P q:<lane>`` set of the tenants that entered the lane's backlog (pruned as the lift
  finds them out of it).
- ``P d:<lane share key>`` hash second -> cost dispatched in that second (lane shares;
  the dispatcher's key is ``<lane>@<engine url>``).
- ``P r:<lease id>`` a released lease's tombstone (for two lease times): a renewal that
  was already on its way when the lease was released must not bring it back.
"""

from __future__ import annotations

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function num(x) return string.format('%.17g', x) end
"""

# Budget level after refill (absent bucket: full); a calendar budget (rate 0, ``ends``
# seconds left in its period) does not refill and expires an hour after its period.
_LEVEL = """
local function level_of(key, tokens, rate)
  local v = redis.call('HMGET', key, 'l', 't')
  if not v[1] then return tokens end
  return math.min(tokens, tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * rate)
end
local function store(key, level, tokens, rate, ends)
  if level >= tokens then redis.call('DEL', key) return end
  redis.call('HSET', key, 'l', num(level), 't', num(now))
  if rate > 0 then
    redis.call('PEXPIRE', key, math.ceil((tokens - level) / rate * 1000) + 1000)
  else
    redis.call('PEXPIRE', key, math.ceil(math.max(0, ends) * 1000) + 3600000)
  end
end
"""

# Slot sets: purge expired leases, count, add, remove.
_SLOTS = """
local function live(key)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now_ms)
  return redis.call('ZCARD', key)
end
local function take(key, id, ttl)
  redis.call('ZADD', key, now_ms + ttl, id)
  redis.call('PEXPIRE', key, 2 * ttl)
end
"""

# The VTC lift: raise tenant's counter (in hash vkey) to the smallest counter among the
# lane's backlogged tenants (a tenant is backlogged while its queued set qprefix..tenant
# holds a live lease), or to the lane's largest counter (mkey) when none is. The set bkey
# holds the tenants that entered the backlog and may still be in it: those found out of it
# are dropped here, so a lift costs O(tenants waiting), never O(tenants of the lane). The
# tenant joins the set: its queued place is taken next.
_LIFT = """
local function lift(vkey, mkey, bkey, tenant, qprefix)
  local floor = nil
  local members = redis.call('SMEMBERS', bkey)
  for i = 1, #members do
    local other = members[i]
    if other ~= tenant then
      if redis.call('ZCOUNT', qprefix .. other, '(' .. now_ms, '+inf') > 0 then
        local c = tonumber(redis.call('HGET', vkey, other) or '0')
        if floor == nil or c < floor then floor = c end
      else
        redis.call('SREM', bkey, other)
      end
    end
  end
  if floor == nil then
    local largest = redis.call('GET', mkey)
    if largest then floor = tonumber(largest) end
  end
  local current = tonumber(redis.call('HGET', vkey, tenant) or '0')
  if floor ~= nil and floor > current then
    current = floor
    redis.call('HSET', vkey, tenant, num(current))
  end
  redis.call('SADD', bkey, tenant)
  return current
end
"""

# Lane shares: a hash per lane share key, field = Redis second, value = cost dispatched in
# that second. lane_add counts a dispatch: O(1), except that the first dispatch of a new
# second drops the seconds older than keep (O(fields), once a second, so a hash nobody
# reads stays bounded). lane_total sums the last window seconds and drops older ones.
_LANE = """
local function lane_add(key, cost, keep)
  local second = math.floor(now)
  if redis.call('HEXISTS', key, second) == 0 then
    local fields = redis.call('HKEYS', key)
    for j = 1, #fields do
      if tonumber(fields[j]) <= second - keep then redis.call('HDEL', key, fields[j]) end
    end
  end
  redis.call('HINCRBYFLOAT', key, second, num(cost))
  redis.call('EXPIRE', key, math.ceil(keep))
end
local function lane_total(key, window)
  local second = math.floor(now)
  local total = 0
  local fields = redis.call('HGETALL', key)
  for j = 1, #fields, 2 do
    if tonumber(fields[j]) <= second - window then redis.call('HDEL', key, fields[j])
    else total = total + tonumber(fields[j + 1]) end
  end
  return total
end
"""

# Budgets: check (no write) whether cost fits; returns worst index (0: fits), levels, wait.
_BUDGET = """
local function check(bkeys, cost, spec)
  local levels = {}
  local worst, worst_wait = 0, 0
  for i = 1, #bkeys do
    local tokens, rate, ends = spec[3 * i - 2], spec[3 * i - 1], spec[3 * i]
    local level = level_of(bkeys[i], tokens, rate)
    levels[i] = level
    local wait = 0
    if cost > tokens then wait = math.huge
    elseif cost > level then
      if rate > 0 then wait = (cost - level) / rate else wait = math.max(0, ends) end
    end
    if wait > worst_wait then worst, worst_wait = i, wait end
  end
  return worst, levels, worst_wait
end
local function refusal(worst, levels, worst_wait, spec)
  local tokens, rate, ends = spec[3 * worst - 2], spec[3 * worst - 1], spec[3 * worst]
  local wait = 'inf'
  if worst_wait ~= math.huge then wait = num(worst_wait) end
  local reset = 0
  if rate > 0 then reset = math.max(0, tokens - levels[worst]) / rate
  elseif levels[worst] < tokens then reset = math.max(0, ends) end
  return {'budget', worst, wait, num(math.max(0, levels[worst])), num(reset)}
end
"""

# One stage, one script: admission. KEYS: nb budget buckets, the tenant's queued set, the
# lane's counter hash, its largest counter, its backlog set. ARGV: nb, cost, three numbers
# per budget, lease id, lease ms, queued limit (-1: none), tenant, the prefix of
# the queued sets' keys.
# Returns {'ok', counter} | {'budget', index, wait, remaining, reset} | {'queue', held}.
ADMIT = _NOW + _LEVEL + _SLOTS + _LIFT + _BUDGET + """
local nb = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
local bkeys, spec = {}, {}
for i = 1, nb do
  bkeys[i] = KEYS[i]
  for j = 0, 2 do spec[3 * i - 2 + j] = tonumber(ARGV[3 * i + j]) end
end
local a = 3 + 3 * nb
local id, ttl, limit, tenant = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), ARGV[a + 3]
local qkey, vkey = KEYS[nb + 1], KEYS[nb + 2]
local waiting = live(qkey)
if limit >= 0 and waiting >= limit then return {'queue', waiting} end
local worst, levels, worst_wait = check(bkeys, cost, spec)
if worst > 0 then return refusal(worst, levels, worst_wait, spec) end
for i = 1, nb do store(bkeys[i], levels[i] - cost, spec[3 * i - 2], spec[3 * i - 1], spec[3 * i]) end
local counter = nil
if waiting == 0 then
  counter = lift(vkey, KEYS[nb + 3], KEYS[nb + 4], tenant, ARGV[a + 4])
else
  counter = tonumber(redis.call('HGET', vkey, tenant) or '0')
end
take(qkey, id, ttl)
return {'ok', num(counter)}
"""

# Dispatch: trade a queued place for running slots and count the lane's dispatched cost.
# KEYS: n claimed slot sets, the queued set given back, the lane's dispatch hash, the
# queued lease's tombstone. ARGV: lease id, lease ms, n, n limits, queued lease id, cost,
# seconds the lane hash keeps.
# Returns {0} or {index, held} of the first full claim.
DISPATCH = _NOW + _SLOTS + _LANE + """
local id, ttl, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 1, n do
  local limit = tonumber(ARGV[3 + i])
  if limit >= 0 then
    local held = live(KEYS[i])
    if held >= limit then return {i, held} end
  end
end
for i = 1, n do take(KEYS[i], id, ttl) end
redis.call('ZREM', KEYS[n + 1], ARGV[4 + n])
redis.call('SET', KEYS[n + 3], '1', 'PX', 2 * ttl)
lane_add(KEYS[n + 2], tonumber(ARGV[5 + n]), tonumber(ARGV[6 + n]))
return {0}
"""

# Settlement: release a lease and settle a reservation. KEYS: ns slot sets and the lease's
# tombstone (when ns > 0), then the budget buckets. ARGV: ns, lease id, delta (reserved -
# actual), lease ms, three numbers per budget.
FINISH = _NOW + _LEVEL + """
local ns = tonumber(ARGV[1])
local off = 0
if ns > 0 then
  for i = 1, ns do redis.call('ZREM', KEYS[i], ARGV[2]) end
  redis.call('SET', KEYS[ns + 1], '1', 'PX', 2 * tonumber(ARGV[4]))
  off = ns + 1
end
local delta = tonumber(ARGV[3])
if delta ~= 0 then
  for i = off + 1, #KEYS do
    local j = i - off
    local tokens, rate, ends = tonumber(ARGV[2 + 3 * j]), tonumber(ARGV[3 + 3 * j]), tonumber(ARGV[4 + 3 * j])
    store(KEYS[i], math.min(tokens, level_of(KEYS[i], tokens, rate) + delta), tokens, rate, ends)
  end
end
return 0
"""

# KEYS: one bucket per budget. ARGV: cost, then three numbers per budget.
# Returns {'ok', level after, ...} (one per budget) when reserved, else {'budget', index,
# wait_s, remaining, reset_s} of the budget with the longest wait (wait "inf": the cost
# exceeds the whole budget).
RESERVE = _NOW + _LEVEL + _BUDGET + """
local cost = tonumber(ARGV[1])
local spec = {}
for i = 2, #ARGV do spec[i - 1] = tonumber(ARGV[i]) end
local worst, levels, worst_wait = check(KEYS, cost, spec)
if worst > 0 then return refusal(worst, levels, worst_wait, spec) end
local out = {'ok'}
for i = 1, #KEYS do
  store(KEYS[i], levels[i] - cost, spec[3 * i - 2], spec[3 * i - 1], spec[3 * i])
  out[i + 1] = num(levels[i] - cost)
end
return out
"""

# KEYS: buckets. ARGV: delta (reserved - actual), then three numbers per budget.
SETTLE = _NOW + _LEVEL + """
local delta = tonumber(ARGV[1])
for i = 1, #KEYS do
  local tokens, rate, ends = tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1])
  store(KEYS[i], math.min(tokens, level_of(KEYS[i], tokens, rate) + delta), tokens, rate, ends)
end
return 0
"""

# KEYS: buckets. ARGV: three numbers per budget. Returns the levels.
LEVELS = _NOW + _LEVEL + """
local out = {}
for i = 1, #KEYS do
  out[i] = num(level_of(KEYS[i], tonumber(ARGV[3 * i - 2]), tonumber(ARGV[3 * i - 1])))
end
return out
"""

# KEYS: n claimed slot sets, then the slot sets of the lease being given back and its
# tombstone (only when one is given back).
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
if old ~= '' then
  for i = n + 1, #KEYS - 1 do redis.call('ZREM', KEYS[i], old) end
  redis.call('SET', KEYS[#KEYS], '1', 'PX', 2 * ttl)
end
return {0}
"""

# KEYS: per lease its tombstone, then its slot sets. ARGV: lease ms, then per lease its id
# and how many slot sets it holds.
# Re-adds a lease Redis lost (restarted without its data, or expired while the holder was
# slow): the request still runs, so it still occupies its slot; never a released lease
# (tombstone). Returns how many were re-added.
RENEW = _NOW + """
local ttl, lost = tonumber(ARGV[1]), 0
local k, a = 1, 2
while a <= #ARGV do
  local id, n = ARGV[a], tonumber(ARGV[a + 1])
  if redis.call('EXISTS', KEYS[k]) == 0 then
    for i = k + 1, k + n do
      lost = lost + redis.call('ZADD', KEYS[i], now_ms + ttl, id)
      redis.call('PEXPIRE', KEYS[i], 2 * ttl)
    end
  end
  k, a = k + n + 1, a + 2
end
return lost
"""

# KEYS: slot sets, then the lease's tombstone. ARGV: lease id, lease ms.
RELEASE = """
for i = 1, #KEYS - 1 do redis.call('ZREM', KEYS[i], ARGV[1]) end
redis.call('SET', KEYS[#KEYS], '1', 'PX', 2 * tonumber(ARGV[2]))
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
LIFT = _NOW + _LIFT + """
return num(lift(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2]))
"""

# Charges to one lane's counters. KEYS: the counter hash, the lane's largest counter.
# ARGV: tenant, amount, tenant, amount, ... Keeps the largest counter (the lift of a lane
# where nobody waits) without reading every tenant's.
CHARGES = """
local largest = tonumber(redis.call('GET', KEYS[2]) or '0')
for i = 1, #ARGV, 2 do
  local c = tonumber(redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1]))
  if c > largest then largest = c end
end
redis.call('SET', KEYS[2], string.format('%.17g', largest))
"""

# KEYS: one dispatch hash per lane. ARGV: window s, then a cost per lane (or nothing to only
# read). With costs: adds them (the hashes keep window s) and returns nothing; without:
# returns each lane's total over the window.
LANES = _NOW + _LANE + """
local window = tonumber(ARGV[1])
local out = {}
for i = 1, #KEYS do
  if ARGV[1 + i] then lane_add(KEYS[i], tonumber(ARGV[1 + i]), window)
  else out[i] = num(lane_total(KEYS[i], window)) end
end
return out
"""

# A paced tenant's rate split (``engines._shared_split``), in hash ``P sp:<tenant>``: fields
# ``n|<replica>|<engine url>`` (that replica's streams there), ``a|<engine url>`` (the
# share the engine paces the tenant at) and ``v`` (the last version given out, a decimal
# string: too large for Lua's numbers). ``P spl:<tenant>`` is the lock of one change;
# ``P spa:<replica>`` says the replica is alive (its counts are ignored, then pruned, once
# it has not renewed it for a lease time). The hash expires a day after its last change.
_SPLIT_LIVE = """
local function live_replica(field, alive_prefix)
  local replica = string.match(field, '^n|([^|]*)|')
  return redis.call('EXISTS', alive_prefix .. replica) == 1
end
"""

# KEYS: hash, lock, own alive key. ARGV: token, lock ms, lease ms, alive key prefix.
# Nil when another change holds the lock; else the hash's fields (live replicas' counts).
SPLIT_READ = _SPLIT_LIVE + """
if not redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return false end
redis.call('SET', KEYS[3], '1', 'PX', ARGV[3])
local flat = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #flat, 2 do
  local f = flat[i]
  if string.sub(f, 1, 2) ~= 'n|' or live_replica(f, ARGV[4]) then
    out[#out + 1] = f
    out[#out + 1] = flat[i + 1]
  end
end
return out
"""

# KEYS: hash, lock, own alive key. ARGV: token, replica, lease ms, alive key prefix, then
# a JSON object {d: {url: +-n}, a: {url: "share"}, v: "version"}. Applies this
# replica's stream changes, replaces the shares, prunes dead replicas' counts, unlocks.
SPLIT_WRITE = _SPLIT_LIVE + """
local body = cjson.decode(ARGV[5])
redis.call('SET', KEYS[3], '1', 'PX', ARGV[3])
for url, d in pairs(body.d) do
  local f = 'n|' .. ARGV[2] .. '|' .. url
  if redis.call('HINCRBY', KEYS[1], f, d) <= 0 then redis.call('HDEL', KEYS[1], f) end
end
for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
  local kind = string.sub(f, 1, 2)
  if kind == 'a|' or (kind == 'n|' and not live_replica(f, ARGV[4])) then
    redis.call('HDEL', KEYS[1], f)
  end
end
for url, r in pairs(body.a) do redis.call('HSET', KEYS[1], 'a|' .. url, r) end
redis.call('HSET', KEYS[1], 'v', body.v)
redis.call('PEXPIRE', KEYS[1], 86400000)
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
return 1
"""

# KEYS: own alive key. ARGV: lease ms.
SPLIT_ALIVE = """
redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
return 1
"""
