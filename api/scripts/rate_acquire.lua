-- One admission against a key's limits, atomically; rate_limit.lua (prepended) holds the logic.
-- KEYS: the requests bucket, the tokens bucket (hashes: level, at), the running counter.
-- ARGV: requests per minute, tokens per minute, at once (-1: no limit, and no place is
--       held), this request's tokens, the bucket period in seconds, the running counter's TTL.
return rate_acquire(KEYS[1], KEYS[2], KEYS[3], tonumber(ARGV[1]), tonumber(ARGV[2]),
                    tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]))
