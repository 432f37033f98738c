-- A request ended: give back its running place and the tokens it reserved but did not use.
-- KEYS: as rate_acquire.lua. ARGV: tokens per minute (-1: no limit), unused tokens, period,
--       at once (-1: the request held no place).
local tpm, unused, period = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if tonumber(ARGV[4]) >= 0 and redis.call('DECR', KEYS[3]) < 0 then
  redis.call('SET', KEYS[3], 0)
end
if tpm >= 0 and unused > 0 then
  local time = redis.call('TIME')
  local now = tonumber(time[1]) + tonumber(time[2]) / 1000000
  local saved = redis.call('HMGET', KEYS[2], 'level', 'at')
  local value, at = tonumber(saved[1]), tonumber(saved[2])
  if value then
    value = math.min(value + (now - at) * tpm / period + unused, tpm)
    redis.call('HSET', KEYS[2], 'level', tostring(value), 'at', tostring(now))
    redis.call('EXPIRE', KEYS[2], math.ceil(period * 2))
  end
end
return 1
