-- RELEASE of per-key admission; KEYS and ARGV: gateway/admission/ratelimit_lua.py.
local member, used, rollback = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1'
local refund = 0
for k = 0, #KEYS - 5, 5 do
  redis.call('ZREM', KEYS[k + 5], member)
  local cur = redis.call('HGET', KEYS[k + 3], member)
  local back = 0
  if cur then
    cur = tonumber(cur)
    if rollback then
      back = cur
      redis.call('HDEL', KEYS[k + 3], member)
      redis.call('ZREM', KEYS[k + 2], member)
    elseif used < cur then
      back = cur - used
      redis.call('HSET', KEYS[k + 3], member, used)
    end
    if back > 0 then redis.call('DECRBY', KEYS[k + 4], back) end
  end
  if rollback then redis.call('ZREM', KEYS[k + 1], member) end
  refund = math.max(refund, back)  -- the same in every set that holds the member
end
return refund
