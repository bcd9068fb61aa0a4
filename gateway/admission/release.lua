-- RELEASE of per-key admission; KEYS and ARGV: gateway/admission/ratelimit_lua.py.
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
