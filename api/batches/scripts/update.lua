-- KEYS: object. ARGV: record JSON. Replaces the record of an object that still exists;
-- returns 1 if it did.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'record', ARGV[1])
return 1
