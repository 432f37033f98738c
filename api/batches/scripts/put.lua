-- KEYS: object, owner index, held, lapse. ARGV: id, record JSON, created_at, kept_until (ms,
-- or ""), blob ("" and ARGV[9] = 0: none), size, quota bytes (-1: not charged), quota count,
-- has blob (1/0), now (s), the most lapsed charges to give back first (lapse.lua).
-- Returns {1} when written, {0, bytes held, count held} when refused.
local charged = tonumber(ARGV[7]) >= 0
local size = tonumber(ARGV[6])
if charged then
  lapse(KEYS[3], KEYS[4], KEYS[2], ARGV[10], ARGV[11])
  local bytes = tonumber(redis.call('HGET', KEYS[3], 'bytes') or '0')
  local count = tonumber(redis.call('HGET', KEYS[3], 'count') or '0')
  if bytes + size > tonumber(ARGV[7]) or count + 1 > tonumber(ARGV[8]) then
    return {0, bytes, count}
  end
end
if ARGV[9] == '1' then
  redis.call('HSET', KEYS[1], 'record', ARGV[2], 'blob', ARGV[5])
else
  redis.call('HSET', KEYS[1], 'record', ARGV[2])
end
if ARGV[4] ~= '' then redis.call('PEXPIREAT', KEYS[1], ARGV[4]) end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
if charged then
  redis.call('HINCRBY', KEYS[3], 'bytes', size)
  redis.call('HINCRBY', KEYS[3], 'count', 1)
  redis.call('HSET', KEYS[3], ARGV[1], size)
  if ARGV[4] ~= '' then redis.call('ZADD', KEYS[4], tonumber(ARGV[4]) / 1000, ARGV[1]) end
end
return {1}
