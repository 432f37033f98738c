-- KEYS: lease. ARGV: holder, ttl ms. Takes a free lease or renews one's own; returns 1 if
-- the holder holds it now.
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
