-- KEYS: record, events, active. ARGV: job id, status, the end entry's id, field/value pairs.
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2], unpack(ARGV, 4))
redis.call('XADD', KEYS[2], ARGV[3], 'end', ARGV[2])
redis.call('PEXPIREAT', KEYS[2], redis.call('HGET', KEYS[1], 'expires_ms'))
redis.call('SREM', KEYS[3], ARGV[1])
return 1
