"""The two Lua scripts of per-key admission (run atomically by Redis, one round trip each).

Algorithm: the sliding-window *log* (Redis "rate limiting" pattern with sorted sets,
see the Redis docs on ZADD/ZREMRANGEBYSCORE and "sliding window rate limiter"):
every admitted request is a member of a sorted set scored by its admission time
(microseconds from ``redis.call('TIME')``, the Redis server's clock, so several
gateway processes share one clock). A request is admitted when, after dropping
members older than the window, ``count < requests_per_min`` and
``reserved_tokens + cost <= tokens_per_min``. Reserved tokens per member live in a
hash and their sum in a counter kept exact by the same scripts (no drift: every
change happens inside a script). Nothing is written unless every check passes.

KEYS (all per API key, hash-tagged ``{key_id}``; the queue stream is global, so
this needs one Redis, not Cluster):
  1 requests zset   2 token zset   3 token hash (member -> tokens)   4 token sum
  5 in-flight zset (member -> expiry, microseconds)   6 the priority's request stream

ADMIT ARGV: member, rpm, tpm, cost (tokens), max_inflight, inflight_ttl_us,
queue_limit, window_us. A limit of 0 is "none". Returns
``{admitted(0/1), reason, retry_after_us, count}`` with reason one of
``ok key_rate key_tokens_never key_tokens in_flight queue_full``.

RELEASE ARGV: member, used_tokens, rollback(0/1). Lowers the member's reservation
to ``used_tokens`` (never raises it: calling twice is harmless), removes it from
the in-flight set, and with rollback removes it from both windows (nothing was
queued). Returns the tokens refunded.
"""

ADMIT = """
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

if rpm > 0 then
  local count = redis.call('ZCARD', KEYS[1])
  if count >= rpm then
    local e = redis.call('ZRANGE', KEYS[1], count - rpm, count - rpm, 'WITHSCORES')
    return {0, 'key_rate', tonumber(e[2]) + window - now, count}
  end
end
if tpm > 0 then
  if cost > tpm then return {0, 'key_tokens_never', 0, 0} end
  local sum = tonumber(redis.call('GET', KEYS[4]) or '0')
  if sum + cost > tpm then
    local entries = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
    local freed = 0
    for i = 1, #entries, 2 do
      freed = freed + tonumber(redis.call('HGET', KEYS[3], entries[i]) or '0')
      if sum - freed + cost <= tpm then
        return {0, 'key_tokens', tonumber(entries[i + 1]) + window - now, sum}
      end
    end
    return {0, 'key_tokens', window, sum}
  end
end
if cap > 0 then
  local running = redis.call('ZCARD', KEYS[5])
  if running >= cap then return {0, 'in_flight', 0, running} end
end
if qlimit > 0 then
  local depth = redis.call('XLEN', KEYS[6])
  if depth >= qlimit then return {0, 'queue_full', 0, depth} end
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
return {1, 'ok', 0, 0}
"""

RELEASE = """
local member, used, rollback = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1'
redis.call('ZREM', KEYS[5], member)
local cur = redis.call('HGET', KEYS[3], member)
local refund = 0
if cur then
  cur = tonumber(cur)
  if rollback then
    refund = cur
    redis.call('HDEL', KEYS[3], member)
    redis.call('ZREM', KEYS[2], member)
  elseif used < cur then
    refund = cur - used
    redis.call('HSET', KEYS[3], member, used)
  end
  if refund > 0 then redis.call('DECRBY', KEYS[4], refund) end
end
if rollback then redis.call('ZREM', KEYS[1], member) end
return refund
"""
