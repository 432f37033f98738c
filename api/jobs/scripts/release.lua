-- KEYS: lease. ARGV: holder. Deletes the lease if the holder holds it; returns how many
-- keys it deleted.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
