-- ADMIT of per-key admission; KEYS and ARGV: gateway/admission/ratelimit_lua.py.
local now_t = redis.call('TIME')
local now = tonumber(now_t[1]) * 1000000 + tonumber(now_t[2])
local member, rpm, tpm, cost = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local cap, ttl, qlimit, window = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local cutoff = now - window

redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', cutoff)
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', cutoff)
for _, m in ipairs(old) do
  local t = tonumber(redis.call('HGET', KEYS[3], m) or '0')
  redis.call('DECRBY', KEYS[4], t)
  redis.call('HDEL', KEYS[3], m)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', cutoff)
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)

local count = 0
if rpm > 0 then count = redis.call('ZCARD', KEYS[1]) end
local sum = 0
if tpm > 0 then sum = tonumber(redis.call('GET', KEYS[4]) or '0') end

-- Microseconds until the newest entry of a window leaves it: the window is empty again.
local function until_empty(key)
  local e = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if #e == 0 then return 0 end
  return math.max(0, tonumber(e[2]) + window - now)
end

-- The rate-limit headers' values, after this request (admitted) or without it.
local function result(admitted, reason, retry_us, n)
  local c, s, rr, rt = count, sum, 0, 0
  if admitted == 1 then c, s = c + 1, s + cost end
  if rpm > 0 then rr = until_empty(KEYS[1]) end
  if tpm > 0 then rt = until_empty(KEYS[2]) end
  return {admitted, reason, retry_us, n, math.max(0, rpm - c), rr, math.max(0, tpm - s), rt}
end

if rpm > 0 then
  if count >= rpm then
    local e = redis.call('ZRANGE', KEYS[1], count - rpm, count - rpm, 'WITHSCORES')
    return result(0, 'key_rate', tonumber(e[2]) + window - now, count)
  end
end
if tpm > 0 then
  if cost > tpm then return result(0, 'key_tokens_never', 0, 0) end
  if sum + cost > tpm then
    local entries = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
    local freed = 0
    for i = 1, #entries, 2 do
      freed = freed + tonumber(redis.call('HGET', KEYS[3], entries[i]) or '0')
      if sum - freed + cost <= tpm then
        return result(0, 'key_tokens', tonumber(entries[i + 1]) + window - now, sum)
      end
    end
    return result(0, 'key_tokens', window, sum)
  end
end
if cap > 0 then
  local running = redis.call('ZCARD', KEYS[5])
  if running >= cap then return result(0, 'in_flight', 0, running) end
end
if qlimit > 0 then
  local depth = 0
  for i = 6, #KEYS do depth = depth + redis.call('XLEN', KEYS[i]) end
  if depth >= qlimit then return result(0, 'queue_full', 0, depth) end
end

local life = math.floor(window / 1000) + 1000
if rpm > 0 then
  redis.call('ZADD', KEYS[1], now, member)
  redis.call('PEXPIRE', KEYS[1], life)
end
if tpm > 0 then
  redis.call('ZADD', KEYS[2], now, member)
  redis.call('HSET', KEYS[3], member, cost)
  redis.call('INCRBY', KEYS[4], cost)
  for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], life) end
end
if cap > 0 then
  redis.call('ZADD', KEYS[5], now + ttl, member)
  redis.call('PEXPIRE', KEYS[5], math.floor(ttl / 1000) + 1000)
end
return result(1, 'ok', 0, 0)
