-- A worker's clean exit. KEYS: the model's worker registry, its load reports, its
-- alive-since set, the worker's taken records, its cache summary. ARGV: worker id, the
-- model's shared queue, the worker's own queue, the prefix of wake lists, the prefixes of
-- kombu's two binding keys of a queue, then the queues' list suffixes. What it still holds, and its own queue after it, go back to the head of the
-- shared queue (a taken record goes back to its own list first, then moves on with it).
local suffixes = {}
for i = 7, #ARGV do suffixes[#suffixes + 1] = ARGV[i] end
local restored = restore_records(KEYS[4], redis.call('HKEYS', KEYS[4]), true)
hand_back(ARGV[3], ARGV[2], suffixes, ARGV[4], nil)
redis.call('DEL', KEYS[4], KEYS[5], ARGV[5] .. ARGV[3], ARGV[6] .. ARGV[3])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return restored
