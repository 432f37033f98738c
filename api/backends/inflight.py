"""Admission's side of the model's in-flight set: check the bound and take a place, atomically.

The in-flight set (``keys.inflight(model)``) is a sorted set of request ids
scored with the time after which an entry stops counting, shared by every
API process. A request enters it at admission, before its preparation,
scored ``RESERVATION_S`` ahead; the job's submission then rescores it to its
total deadline, and its end removes it. Counting ``ZCOUNT now +inf`` skips
what a crashed process left behind, and the fleet watcher prunes it.

Checking the count and adding the entry in one script is what keeps several
API processes from overshooting ``--max-inflight``: with a count read first
and an entry added later, each process admitted what the others were still
preparing.
"""

from __future__ import annotations

import logging
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from api.admission import api_error
from shared import keys

log = logging.getLogger(__name__)

RESERVATION_S = 30.0
"""How long an admitted request's place lasts before its job is queued: preparation
takes milliseconds, so this only bounds what a request lost before submission holds."""

RESERVE_SCRIPT = """
-- KEYS[1]: the in-flight set. ARGV: now, the bound, the reservation's expiry, then request ids.
local now = tonumber(ARGV[1])
local count = redis.call('ZCOUNT', KEYS[1], now, '+inf')
local bound = tonumber(ARGV[2])
local admitted = {}
for i = 4, #ARGV do
  if count >= bound then break end
  local score = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[i]))
  if score == nil or score < now then  -- not counted yet (an id already in place keeps it)
    redis.call('ZADD', KEYS[1], ARGV[3], ARGV[i])
    count = count + 1
  end
  admitted[#admitted + 1] = ARGV[i]
end
return admitted
"""


class InflightPlaces:
    """Reserve and give back places in one model's in-flight set (for ``Admission``)."""

    def __init__(self, client: Redis, model: str, bound: int) -> None:
        self._client = client
        self._key = keys.inflight(model)
        self._bound = bound
        self._script = client.register_script(RESERVE_SCRIPT)

    async def reserve(self, request_ids: list[str]) -> set[str]:
        """The ids admitted, in order, while the count stays within the bound."""
        now = time.time()
        try:
            admitted = await self._script(
                keys=[self._key], args=[now, self._bound, now + RESERVATION_S, *request_ids]
            )
        except (RedisError, OSError) as exc:
            raise api_error("unavailable", f"Redis is unreachable ({exc}); retry later.") from exc
        return {_text(request_id) for request_id in admitted}

    async def release(self, request_id: str) -> None:
        """Give back the place of a request that ends before its job was queued."""
        try:
            await self._client.zrem(self._key, request_id)
        except (RedisError, OSError) as exc:  # its reservation expires on its own
            log.warning("giving back the place of %s failed: %s", request_id, exc)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
