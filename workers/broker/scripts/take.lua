-- Takes up to a worker's credit of jobs, records each as taken by that worker, starts each.
-- KEYS: the worker's taken records, the queues' wake lists (one per queue), then the queue
-- lists in kombu's BRPOP order: priority-major, so list i (from 0) belongs to queue i % #queues.
-- ARGV: how many messages to pop, the number of queues, then the key prefixes of leases,
-- cancel flags, event streams and API processes, a lease's TTL and the header naming a
-- message's job.
-- Returns the messages popped (key, message, ...) and the jobs started (request id,
-- {attempt, cancel flag, stream entries, origin alive, delivery tag}, ...).
-- Runs right after the wake-up read on the same connection, which may or may not have popped
-- a token: it leaves each wake list as long as the jobs still queued, neither more nor fewer.
local queues = tonumber(ARGV[2])
local first_list = 2 + queues
-- A key of the wrong type would fail a write halfway, after messages were popped: refuse
-- before any write instead, leaving every job where it is.
for i = 1, #KEYS do
  local kind = redis.call('TYPE', KEYS[i])['ok']
  local wanted = (i == 1) and 'hash' or 'list'
  if kind ~= 'none' and kind ~= wanted then
    return redis.error_reply('WRONGTYPE ' .. KEYS[i] .. ' is a ' .. kind .. ', not a ' .. wanted)
  end
end
local started = {}
local function start(headers, tag)
  if type(headers) ~= 'table' then return end
  local job = headers[ARGV[8]]
  if type(job) ~= 'table' or type(job[1]) ~= 'string' then return end
  local request, origin = job[1], job[2]
  local lease = ARGV[3] .. request
  local attempt = redis.pcall('INCR', lease)  -- an error fails this job alone
  redis.pcall('EXPIRE', lease, ARGV[7])
  local alive = 1
  if type(origin) == 'string' and origin ~= '' then
    alive = redis.pcall('EXISTS', ARGV[6] .. origin)
  end
  local cancelled = redis.pcall('EXISTS', ARGV[4] .. request)
  local entries = redis.pcall('XRANGE', ARGV[5] .. request, '-', '+')
  started[#started + 1] = request
  started[#started + 1] = {attempt, cancelled, entries, alive, tag}
end
local function record(item, list, wake)
  local ok, message = pcall(cjson.decode, item)
  if not ok or type(message) ~= 'table' then return end
  local properties = message['properties']
  if type(properties) ~= 'table' then return end
  local tag = properties['delivery_tag']
  if type(tag) == 'number' and tag == math.floor(tag) then
    tag = string.format('%d', tag)  -- kombu acks it by the same digits
  end
  if type(tag) ~= 'string' then return end
  redis.call('HSET', KEYS[1], tag, wake .. '\n' .. list .. '\n' .. item)
  start(message['headers'], tag)
end
local taken = {}
local wanted = tonumber(ARGV[1])
local queued = {}
for q = 1, queues do queued[q] = 0 end
for i = first_list, #KEYS do
  local q = (i - first_list) % queues + 1
  while wanted > 0 do
    local item = redis.call('RPOP', KEYS[i])
    if not item then break end
    record(item, KEYS[i], KEYS[1 + q])
    taken[#taken + 1] = KEYS[i]
    taken[#taken + 1] = item
    wanted = wanted - 1
  end
  queued[q] = queued[q] + redis.call('LLEN', KEYS[i])
end
for q = 1, queues do
  local wake = KEYS[1 + q]
  local tokens = redis.call('LLEN', wake)
  if queued[q] == 0 then
    redis.call('DEL', wake)
  elseif tokens > queued[q] then
    redis.call('LTRIM', wake, 0, queued[q] - 1)
  elseif tokens < queued[q] then  -- for other workers (this one took what its credit allows)
    for _ = tokens + 1, queued[q] do redis.call('LPUSH', wake, '1') end
  end
end
return {taken, started}
