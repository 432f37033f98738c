-- A request ended: give back its running place and the tokens it reserved but did not use;
-- a request that never ran (its batch was refused) gives back its request too.
-- KEYS: as rate_acquire.lua. ARGV: tokens per minute (-1: no limit), unused tokens, period,
--       at once (-1: the request held no place), requests per minute (-1: no limit),
--       unused requests.
local tpm, unused, period = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local rpm, unused_requests = tonumber(ARGV[5]), tonumber(ARGV[6])
if tonumber(ARGV[4]) >= 0 and redis.call('DECR', KEYS[3]) < 0 then
  redis.call('SET', KEYS[3], 0)
end

local function refill(key, limit, amount)
  if limit < 0 or amount <= 0 then return end
  local time = redis.call('TIME')
  local now = tonumber(time[1]) + tonumber(time[2]) / 1000000
  local saved = redis.call('HMGET', key, 'level', 'at')
  local value, at = tonumber(saved[1]), tonumber(saved[2])
  if value then
    value = math.min(value + (now - at) * limit / period + amount, limit)
    redis.call('HSET', key, 'level', tostring(value), 'at', tostring(now))
    redis.call('EXPIRE', key, math.ceil(period * 2))
  end
end

refill(KEYS[2], tpm, unused)
refill(KEYS[1], rpm, unused_requests)
return 1
