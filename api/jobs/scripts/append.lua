-- KEYS: record, events. ARGV: index of the first chunk, then data/event pairs ("": no event).
-- Refused (0) once the job ended or expired, or when an index is taken.
local expires = redis.call('HGET', KEYS[1], 'expires_ms')
local status = redis.call('HGET', KEYS[1], 'status')
if (not expires) or (status ~= 'queued' and status ~= 'running') then return 0 end
local index = tonumber(ARGV[1])
for i = 2, #ARGV, 2 do
  local reply
  if ARGV[i + 1] == '' then
    reply = redis.pcall('XADD', KEYS[2], index .. '-0', 'd', ARGV[i])
  else
    reply = redis.pcall('XADD', KEYS[2], index .. '-0', 'd', ARGV[i], 'e', ARGV[i + 1])
  end
  if type(reply) == 'table' and reply.err then return 0 end
  index = index + 1
end
redis.call('PEXPIREAT', KEYS[2], expires)
return 1
