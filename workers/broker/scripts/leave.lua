-- A worker's clean exit. KEYS: the model's worker registry, its load reports, its
-- alive-since set, the worker's taken records. ARGV: worker id. What it still holds goes
-- back to the head of its queues.
local restored = restore_records(KEYS[4], redis.call('HKEYS', KEYS[4]), true)
redis.call('DEL', KEYS[4])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return restored
