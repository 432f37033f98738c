-- One admission against a key's limits, atomically (api/rate_limits.py mirrors it in memory).
-- KEYS: the requests bucket, the tokens bucket (hashes: level, at), the running counter.
-- ARGV: requests per minute, tokens per minute, at once (-1: no limit, and no place is
--       held), this request's tokens, the bucket period in seconds, the running counter's TTL.
-- Returns {allowed, requests left, tokens left, retry after (s), reason}; levels as strings.
local rpm, tpm, most = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tokens, period, ttl = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1000000

local function level(key, limit)
  if limit < 0 then return nil end
  local saved = redis.call('HMGET', key, 'level', 'at')
  local value, at = tonumber(saved[1]), tonumber(saved[2])
  if not value then return limit end
  return math.min(value + (now - at) * limit / period, limit)
end

local requests, token_level = level(KEYS[1], rpm), level(KEYS[2], tpm)
local running = tonumber(redis.call('GET', KEYS[3]) or '0')
local function show(value) return value and tostring(value) or '-1' end

if tpm >= 0 and tokens > tpm then
  return {0, show(requests), show(token_level), tostring(period),
          'this request needs ' .. tokens .. ' tokens (prompt and max_tokens), more than the key\'s '
          .. tpm .. ' tokens per minute; lower max_tokens'}
end
local wait, what = 0, nil
if requests and requests < 1 then
  wait, what = (1 - requests) * period / rpm, rpm .. ' requests per minute'
end
if token_level and token_level < tokens then
  local needed = (tokens - token_level) * period / tpm
  if needed > wait then wait, what = needed, tpm .. ' tokens per minute' end
end
if most >= 0 and running >= most then
  if 1 > wait then wait, what = 1, most .. ' requests at once' end
end
if what then
  return {0, show(requests), show(token_level), tostring(wait),
          'rate limit reached: this key may make ' .. what}
end

local function take(key, value, amount)
  if not value then return nil end
  redis.call('HSET', key, 'level', tostring(value - amount), 'at', tostring(now))
  redis.call('EXPIRE', key, math.ceil(period * 2))
  return value - amount
end
requests = take(KEYS[1], requests, 1)
token_level = take(KEYS[2], token_level, tokens)
if most >= 0 then
  redis.call('INCR', KEYS[3])
  redis.call('EXPIRE', KEYS[3], ttl)
end
return {1, show(requests), show(token_level), '0', ''}
