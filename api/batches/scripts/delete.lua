-- KEYS: object, lease, active, owner index, held, lapse. ARGV: id. Forgets the object and
-- gives its charge back; returns how many of the object and its lease were deleted.
local deleted = redis.call('DEL', KEYS[1], KEYS[2])
redis.call('SREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[6], ARGV[1])
local size = redis.call('HGET', KEYS[5], ARGV[1])
if size then
  redis.call('HINCRBY', KEYS[5], 'bytes', 0 - tonumber(size))
  redis.call('HINCRBY', KEYS[5], 'count', -1)
  redis.call('HDEL', KEYS[5], ARGV[1])
end
return deleted
