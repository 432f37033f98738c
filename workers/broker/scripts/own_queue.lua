-- Shared by beat.lua and leave.lua (prepended when the scripts are loaded).
-- A worker's own queue holds the jobs the API placed there for the prefix its cache holds;
-- its lists and wake list are named as the shared queue's are (the same priority suffixes).
-- A job's header names the time it is handed back by (shared.task_message).
-- hand_back moves each job of the own queue's lists whose hand-back time is at or before `due`
-- (nil: every job) to the head of the shared list of the same priority, oldest first in line,
-- moves its wake token with it and returns how many jobs moved.
local function hand_back_due(item, due)
  if not due then return true end
  local ok, message = pcall(cjson.decode, item)
  if not ok or type(message) ~= 'table' or type(message['headers']) ~= 'table' then
    return true  -- unreadable here: the shared queue is where any worker can take it
  end
  local job = message['headers']['sluice_request']
  local by = type(job) == 'table' and tonumber(job[3]) or nil
  return by == nil or by <= due
end

local function hand_back(own, shared, suffixes, wake_prefix, due)
  local moved, left = 0, 0
  for _, suffix in ipairs(suffixes) do
    local from, to = own .. suffix, shared .. suffix
    local items = {}
    while true do
      local item = redis.call('LINDEX', from, -1)
      if not item or not hand_back_due(item, due) then break end
      items[#items + 1] = redis.call('RPOP', from)
    end
    for i = #items, 1, -1 do redis.call('RPUSH', to, items[i]) end
    moved = moved + #items
    left = left + redis.call('LLEN', from)
  end
  if moved > 0 then
    local own_wake = wake_prefix .. own
    for _ = 1, moved do redis.call('LPUSH', wake_prefix .. shared, '1') end
    if left == 0 then
      redis.call('DEL', own_wake)
    elseif redis.call('LLEN', own_wake) > left then
      redis.call('LTRIM', own_wake, 0, left - 1)
    end
  end
  return moved
end
