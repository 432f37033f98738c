-- KEYS: the job's list, its wake list, then the shared queue's list and wake list its
-- message moves to if handed back from a worker's own queue. ARGV: its message.
-- Removes a job no worker has taken yet, and a wake token with it. Returns 1 if removed.
for i = 1, 3, 2 do
  if redis.call('LREM', KEYS[i], 1, ARGV[1]) == 1 then
    redis.call('RPOP', KEYS[i + 1])
    return 1
  end
end
return 0
