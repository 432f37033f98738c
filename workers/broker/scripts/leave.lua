-- A worker's clean exit. KEYS: the model's worker registry, its load reports, the worker's
-- taken records. ARGV: worker id. What it still holds goes back to the head of its queues.
local restored = restore_records(KEYS[3], redis.call('HKEYS', KEYS[3]), true)
redis.call('DEL', KEYS[3])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return restored
