-- One heartbeat: the worker's registry entry and load report, and the jobs of dead workers.
-- KEYS: the model's worker registry (sorted set: worker id -> expiry, Redis's clock), the
-- model's load reports (hash: worker id -> JSON).
-- ARGV: worker id, report, TTL in seconds, '1' to reclaim dead workers' jobs, the key prefix
-- of taken records (the worker id follows it).
-- Returns the ids of the dead workers reclaimed and how many jobs went back to their queues.
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
local dead, restored = {}, 0
if ARGV[4] == '1' then
  for _, worker in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)) do
    local taken = ARGV[5] .. worker
    restored = restored + restore_records(taken, redis.call('HKEYS', taken), true)
    redis.call('DEL', taken)
    redis.call('ZREM', KEYS[1], worker)
    redis.call('HDEL', KEYS[2], worker)
    dead[#dead + 1] = worker
  end
end
return {dead, restored}
