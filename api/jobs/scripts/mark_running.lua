-- KEYS: record. ARGV: started_at.
if redis.call('HGET', KEYS[1], 'status') ~= 'queued' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'running', 'started_at', ARGV[1])
return 1
