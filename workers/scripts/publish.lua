-- Fenced event publishing (workers/publisher.py): one engine step's events, every request's,
-- written only under each request's current attempt.
-- KEYS: the model's in-flight set, then (lease, stream) per request.
-- ARGV: maxlen, ttl, "1" if this write may repeat one that already ran,
--   REFRESH_EVERY (workers/publisher.py), then per request: attempt, the first event's sequence
--   number, event count, its id if the events end it (else ""), and per
--   event: field count n, then n field/value pairs.
-- A current lease and its stream get the time to live of a finished stream
-- when an attempt starts writing, every REFRESH_EVERY events and at the end
-- (not at every write, which would double the script's cost), so both
-- outlive any generation that keeps writing and a stream whose writer died
-- expires on its own. A repeated write (sent again after its reply was lost) skips the
-- events the stream's last entry says this attempt already wrote. A request's end takes
-- it out of the in-flight set, as its API does when it reads the end: an API
-- that died would leave it counted against the model's bound until its
-- deadline. Returns the 1-based indexes of the requests whose lease is not
-- their attempt.
local maxlen, ttl, repeated, every = ARGV[1], ARGV[2], ARGV[3] == '1', tonumber(ARGV[4])
local fenced = {}
local pos = 5

local function written(stream, attempt)
  local tail = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)[1]
  if not tail then return 0 end
  local fields, a, s = tail[2], nil, 0
  for f = 1, #fields, 2 do
    if fields[f] == 'a' then a = fields[f + 1] elseif fields[f] == 's' then s = fields[f + 1] end
  end
  if a == attempt then return tonumber(s) end
  return 0
end

local function refreshes(seq, count, ends)
  local crossed = math.floor((seq + count - 1) / every) > math.floor((seq - 1) / every)
  return seq == 1 or ends ~= '' or crossed
end

for i = 2, #KEYS, 2 do
  local attempt, seq = ARGV[pos], tonumber(ARGV[pos + 1])
  local count, ends = tonumber(ARGV[pos + 2]), ARGV[pos + 3]
  pos = pos + 4
  local current = redis.call('GET', KEYS[i]) == attempt
  local done = 0
  if current and repeated then
    done = written(KEYS[i + 1], attempt)
  elseif not current then
    fenced[#fenced + 1] = i / 2
  end
  for e = 0, count - 1 do
    local nfields = tonumber(ARGV[pos])
    if current and seq + e > done then
      local entry = {'XADD', KEYS[i + 1], 'MAXLEN', '~', maxlen, '*'}
      for f = pos + 1, pos + 2 * nfields do
        entry[#entry + 1] = ARGV[f]
      end
      redis.call(unpack(entry))
    end
    pos = pos + 1 + 2 * nfields
  end
  if current and refreshes(seq, count, ends) then
    redis.call('EXPIRE', KEYS[i], ttl)
    redis.call('EXPIRE', KEYS[i + 1], ttl)
    if ends ~= '' then
      redis.call('ZREM', KEYS[1], ends)
    end
  end
end
return fenced
