-- One heartbeat: the worker's registry entry and load report, and the jobs of dead workers.
-- KEYS: the model's worker registry (sorted set: worker id -> expiry), the model's load
-- reports (hash: worker id -> JSON), the model's alive-since set (sorted set: worker id ->
-- when its entry last went from expired or missing to renewed), all on Redis's clock.
-- ARGV: worker id, report, TTL in seconds, the key prefix of taken records (the worker id
-- follows it).
-- A worker reclaims only once its own entry has stayed renewed for a whole TTL: after Redis
-- stalled or was away, every entry has expired, and each live worker must have had the
-- time to renew its own before any is taken for dead.
-- Returns the ids of the dead workers reclaimed and how many jobs went back to their queues.
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local ttl = tonumber(ARGV[3])
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
local since = redis.call('ZSCORE', KEYS[3], ARGV[1])
if not expiry or tonumber(expiry) < now or not since then
  since = now
  redis.call('ZADD', KEYS[3], now, ARGV[1])
end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
local dead, restored = {}, 0
if now - tonumber(since) >= ttl then
  for _, worker in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)) do
    local taken = ARGV[4] .. worker
    restored = restored + restore_records(taken, redis.call('HKEYS', taken), true)
    redis.call('DEL', taken)
    redis.call('ZREM', KEYS[1], worker)
    redis.call('ZREM', KEYS[3], worker)
    redis.call('HDEL', KEYS[2], worker)
    dead[#dead + 1] = worker
  end
end
return {dead, restored}
