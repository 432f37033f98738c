-- One heartbeat: the worker's registry entry and load report, its own queue's overdue jobs,
-- its cache summary's expiry, and the jobs of dead workers.
-- KEYS: the model's worker registry (sorted set: worker id -> expiry), the model's load
-- reports (hash: worker id -> JSON), the model's alive-since set (sorted set: worker id ->
-- when its entry last went from expired or missing to renewed), all on Redis's clock.
-- ARGV: worker id, report, TTL in seconds, the key prefix of taken records (the worker id
-- follows it), the model's shared queue, the prefix of its workers' own queues (the worker id
-- follows it), the prefix of wake lists, the prefix of cache summaries, a summary's TTL,
-- '1' if the worker drains (its whole own queue goes back), the prefixes of kombu's two
-- binding keys of a queue (a dead worker's own queue's are deleted), then the queues' list
-- suffixes.
-- A worker reclaims only once its own entry has stayed renewed for a whole TTL: after Redis
-- stalled or was away, every entry has expired, and each live worker must have had the
-- time to renew its own before any is taken for dead.
-- Returns the ids of the dead workers reclaimed, how many of their jobs went back to the
-- shared queue, how many of this worker's own queue did, and whether its summary exists.
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local worker, ttl = ARGV[1], tonumber(ARGV[3])
local shared, own_prefix, wake_prefix, summary_prefix = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local suffixes = {}
for i = 13, #ARGV do suffixes[#suffixes + 1] = ARGV[i] end
local expiry = redis.call('ZSCORE', KEYS[1], worker)
local since = redis.call('ZSCORE', KEYS[3], worker)
if not expiry or tonumber(expiry) < now or not since then
  since = now
  redis.call('ZADD', KEYS[3], now, worker)
end
redis.call('ZADD', KEYS[1], now + ttl, worker)
redis.call('HSET', KEYS[2], worker, ARGV[2])
local due = now
if ARGV[10] == '1' then due = nil end
local handed = hand_back(own_prefix .. worker, shared, suffixes, wake_prefix, due)
local summary = redis.call('EXPIRE', summary_prefix .. worker, ARGV[9])
local dead, restored = {}, 0
if now - tonumber(since) >= ttl then
  for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)) do
    local taken = ARGV[4] .. gone
    restored = restored + restore_records(taken, redis.call('HKEYS', taken), true)
    local own = own_prefix .. gone
    hand_back(own, shared, suffixes, wake_prefix, nil)
    redis.call('DEL', taken, summary_prefix .. gone, ARGV[11] .. own, ARGV[12] .. own)
    redis.call('ZREM', KEYS[1], gone)
    redis.call('ZREM', KEYS[3], gone)
    redis.call('HDEL', KEYS[2], gone)
    dead[#dead + 1] = gone
  end
end
return {dead, restored, handed, summary}
