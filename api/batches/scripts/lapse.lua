-- Shared by put.lua and held.lua (their prelude). lapse(held, lapse, owner index, now (unix
-- s), most) gives back the charges of the owner's objects whose time is up, at most `most`
-- of them (api/batches/objects.py: LAPSE_BATCH), so that a write stays short.
local function lapse(held, lapsing, owned, now, most)
  local gone = redis.call('ZRANGEBYSCORE', lapsing, '-inf', now, 'LIMIT', 0, most)
  for _, id in ipairs(gone) do
    local size = redis.call('HGET', held, id)
    if size then
      redis.call('HINCRBY', held, 'bytes', 0 - tonumber(size))
      redis.call('HINCRBY', held, 'count', -1)
      redis.call('HDEL', held, id)
    end
    redis.call('ZREM', lapsing, id)
    redis.call('ZREM', owned, id)
  end
end
