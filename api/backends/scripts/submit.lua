-- Queues a job under its model's bound on outstanding work and, with a key's share, under
-- the key's rate limits (rate_acquire: api/scripts/rate_limit.lua, this script's prelude).
-- KEYS: the model's in-flight set, the queue's list, its wake list; then, if ARGV[9] is '1',
-- the key's rate-limit keys (rate_limit.lua); then the event reader's interrupt stream if
-- ARGV[7] is '1'; then the job's origin key when it has one.
-- ARGV: now, the bound (0: none), the job's in-flight score, its request id, its message,
-- the origin key's TTL, whether to interrupt the reader's read, the interrupt stream's TTL,
-- whether a key's share is taken, then rate_acquire's six arguments.
-- Returns {1} if queued, {0} if refused by the bound (the set already counted it); with a
-- share, {1 or -1 (refused by the key's limits), then rate_acquire's verdict}.
local rated = ARGV[9] == '1'
local next_key = rated and 7 or 4
if ARGV[7] == '1' then  -- whether queued or refused: the reader reads this job's stream next
  redis.call('XADD', KEYS[next_key], 'MAXLEN', 1, '*', 'w', '1')
  redis.call('EXPIRE', KEYS[next_key], ARGV[8])
  next_key = next_key + 1
end
local bound = tonumber(ARGV[2])
if bound > 0 and redis.call('ZCOUNT', KEYS[1], ARGV[1], '+inf') >= bound then
  return {0}
end
local verdict = nil
if rated then
  verdict = rate_acquire(KEYS[4], KEYS[5], KEYS[6], tonumber(ARGV[10]), tonumber(ARGV[11]),
                         tonumber(ARGV[12]), tonumber(ARGV[13]), tonumber(ARGV[14]),
                         tonumber(ARGV[15]))
  if verdict[1] == 0 then
    return {-1, verdict[2], verdict[3], verdict[4], verdict[5]}
  end
end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
redis.call('LPUSH', KEYS[2], ARGV[5])
redis.call('LPUSH', KEYS[3], '1')
if KEYS[next_key] then
  redis.call('SET', KEYS[next_key], '1', 'EX', ARGV[6])
end
if verdict then
  return {1, verdict[2], verdict[3], verdict[4], verdict[5]}
end
return {1}
