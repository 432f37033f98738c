-- Shared by restore.lua, beat.lua and leave.lua (prepended when the scripts are loaded).
-- A taken record is '<wake list>\n<queue list>\n<message>': restore_records puts each named
-- record's message back on its queue list (its head, RPUSH, or its tail, LPUSH), pushes a
-- wake token beside it, and deletes the record. A record not in that form cannot be put
-- back: it is deleted, and logged. Returns how many messages went back.
local function restore_records(taken, tags, at_head)
  local restored = 0
  for _, tag in ipairs(tags) do
    local record = redis.call('HGET', taken, tag)
    if record then
      local first = string.find(record, '\n', 1, true)
      local second = first and string.find(record, '\n', first + 1, true)
      if second then
        local wake = string.sub(record, 1, first - 1)
        local list = string.sub(record, first + 1, second - 1)
        local message = string.sub(record, second + 1)
        if at_head then
          redis.call('RPUSH', list, message)
        else
          redis.call('LPUSH', list, message)
        end
        redis.call('LPUSH', wake, '1')
        restored = restored + 1
      else
        redis.log(redis.LOG_WARNING, 'sluice: dropping a malformed taken record ' .. tag)
      end
      redis.call('HDEL', taken, tag)
    end
  end
  return restored
end
