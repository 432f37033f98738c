-- KEYS: held, lapse, owner index. ARGV: now (s), the most lapsed charges to give back first
-- (lapse.lua). Returns {bytes, count} held after that.
lapse(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2])
return {tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0'),
        tonumber(redis.call('HGET', KEYS[1], 'count') or '0')}
