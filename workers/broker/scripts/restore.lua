-- KEYS: one worker's taken records. ARGV: 'head' or 'tail', then the delivery tags to
-- put back (none: every record). Returns how many messages went back to their queues.
local tags = {}
for i = 2, #ARGV do tags[#tags + 1] = ARGV[i] end
if #tags == 0 then tags = redis.call('HKEYS', KEYS[1]) end
return restore_records(KEYS[1], tags, ARGV[1] == 'head')
