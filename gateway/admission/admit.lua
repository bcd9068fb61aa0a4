-- ADMIT of per-key admission; KEYS and ARGV: gateway/admission/ratelimit_lua.py.
local now_t = redis.call('TIME')
local now = tonumber(now_t[1]) * 1000000 + tonumber(now_t[2])
local member, cost, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local qlimit, window, nsets = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local cutoff = now - window

-- Window set s (1 = the key's, 2 = the key's for this model): its five keys and limits.
local sets = {}
for s = 1, nsets do
  local k, a = (s - 1) * 5, 6 + (s - 1) * 3
  sets[s] = {req = KEYS[k + 1], tok = KEYS[k + 2], amt = KEYS[k + 3], sum = KEYS[k + 4], run = KEYS[k + 5],
             rpm = tonumber(ARGV[a + 1]), tpm = tonumber(ARGV[a + 2]), cap = tonumber(ARGV[a + 3])}
end

-- Drop what left the windows; count what is left.
for _, w in ipairs(sets) do
  redis.call('ZREMRANGEBYSCORE', w.req, '-inf', cutoff)
  local old = redis.call('ZRANGEBYSCORE', w.tok, '-inf', cutoff)
  for _, m in ipairs(old) do
    redis.call('DECRBY', w.sum, tonumber(redis.call('HGET', w.amt, m) or '0'))
    redis.call('HDEL', w.amt, m)
  end
  redis.call('ZREMRANGEBYSCORE', w.tok, '-inf', cutoff)
  redis.call('ZREMRANGEBYSCORE', w.run, '-inf', now)
  w.count, w.sum_now = 0, 0
  if w.rpm > 0 then w.count = redis.call('ZCARD', w.req) end
  if w.tpm > 0 then w.sum_now = tonumber(redis.call('GET', w.sum) or '0') end
end

-- Microseconds until the newest entry of a window leaves it: the window is empty again.
local function until_empty(key)
  local e = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if #e == 0 then return 0 end
  return math.max(0, tonumber(e[2]) + window - now)
end

-- The rate-limit headers' values, after this request (admitted) or without it: per unit, the
-- set with a limit and the least left (the one that refuses first).
local function result(admitted, reason, retry_us, n, at)
  local out = {admitted, reason, retry_us, n, at, 0, 0, 0, 0, 0, 0}
  for _, w in ipairs(sets) do
    local c, s = w.count, w.sum_now
    if admitted == 1 then c, s = c + 1, s + cost end
    if w.rpm > 0 and (out[6] == 0 or w.rpm - c < out[7]) then
      out[6], out[7], out[8] = w.rpm, math.max(0, w.rpm - c), until_empty(w.req)
    end
    if w.tpm > 0 and (out[9] == 0 or w.tpm - s < out[10]) then
      out[9], out[10], out[11] = w.tpm, math.max(0, w.tpm - s), until_empty(w.tok)
    end
  end
  return out
end

for i, w in ipairs(sets) do
  if w.rpm > 0 and w.count >= w.rpm then
    local e = redis.call('ZRANGE', w.req, w.count - w.rpm, w.count - w.rpm, 'WITHSCORES')
    return result(0, 'key_rate', tonumber(e[2]) + window - now, w.count, i)
  end
  if w.tpm > 0 then
    if cost > w.tpm then return result(0, 'key_tokens_never', 0, 0, i) end
    if w.sum_now + cost > w.tpm then
      local entries = redis.call('ZRANGE', w.tok, 0, -1, 'WITHSCORES')
      local freed = 0
      for j = 1, #entries, 2 do
        freed = freed + tonumber(redis.call('HGET', w.amt, entries[j]) or '0')
        if w.sum_now - freed + cost <= w.tpm then
          return result(0, 'key_tokens', tonumber(entries[j + 1]) + window - now, w.sum_now, i)
        end
      end
      return result(0, 'key_tokens', window, w.sum_now, i)
    end
  end
  if w.cap > 0 then
    local running = redis.call('ZCARD', w.run)
    if running >= w.cap then return result(0, 'in_flight', 0, running, i) end
  end
end
if qlimit > 0 then
  local depth = 0
  for i = nsets * 5 + 1, #KEYS do depth = depth + redis.call('XLEN', KEYS[i]) end
  if depth >= qlimit then return result(0, 'queue_full', 0, depth, 0) end
end

local life = math.floor(window / 1000) + 1000
for _, w in ipairs(sets) do
  if w.rpm > 0 then
    redis.call('ZADD', w.req, now, member)
    redis.call('PEXPIRE', w.req, life)
  end
  if w.tpm > 0 then
    redis.call('ZADD', w.tok, now, member)
    redis.call('HSET', w.amt, member, cost)
    redis.call('INCRBY', w.sum, cost)
    for _, key in ipairs({w.tok, w.amt, w.sum}) do redis.call('PEXPIRE', key, life) end
  end
  if w.cap > 0 then
    redis.call('ZADD', w.run, now + ttl, member)
    redis.call('PEXPIRE', w.run, math.floor(ttl / 1000) + 1000)
  end
end
return result(1, 'ok', 0, 0, 0)
