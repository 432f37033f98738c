-- Per-key rate limits, shared by the scripts that admit a request (api/rate_limits.py
-- mirrors them in memory): the standalone admission (rate_acquire.lua) and the request
-- queue's submit script, which takes a key's share in the same call that queues the request.
--
-- rate_acquire(requests bucket, tokens bucket, running counter, requests per minute, tokens
-- per minute, at once, tokens, period, running TTL): checks all three limits and, only when
-- every one allows, takes one request, the tokens and (under an "at once" limit) a place.
-- A limit of -1 is none. Returns {allowed, requests left, tokens left, retry after (s; -1:
-- no wait helps, the request is larger than a minute's tokens), reason}, levels as strings
-- (-1: no such limit).
local function rate_acquire(requests_key, tokens_key, running_key, rpm, tpm, most, tokens,
                            period, ttl)
  local time = redis.call('TIME')
  local now = tonumber(time[1]) + tonumber(time[2]) / 1000000

  local function level(key, limit)
    if limit < 0 then return nil end
    local saved = redis.call('HMGET', key, 'level', 'at')
    local value, at = tonumber(saved[1]), tonumber(saved[2])
    if not value then return limit end
    return math.min(value + (now - at) * limit / period, limit)
  end

  local requests, token_level = level(requests_key, rpm), level(tokens_key, tpm)
  local running = tonumber(redis.call('GET', running_key) or '0')
  local function show(value) return value and tostring(value) or '-1' end

  if tpm >= 0 and tokens > tpm then
    return {0, show(requests), show(token_level), '-1',
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
  requests = take(requests_key, requests, 1)
  token_level = take(tokens_key, token_level, tokens)
  if most >= 0 then
    redis.call('INCR', running_key)
    redis.call('EXPIRE', running_key, ttl)
  end
  return {1, show(requests), show(token_level), '0', ''}
end
