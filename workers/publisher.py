"""Fenced event publishing: a stale attempt's writes never reach a stream.

A request can have two live writers: a worker that lost its broker
connection (or was merely slow) and the worker its redelivered job went to.
Each run holds an attempt number; ``lease(request_id)`` holds the current
one. One Lua script writes a whole engine step, every request's events,
in one round trip, and checks each request's lease before its ``XADD``s, so
the check and the write are atomic on the server: a stale attempt's events
are dropped there, and the script names those requests so the worker stops
generating for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import redis

from shared import keys
from shared.event_codec import encode_event
from shared.events import Error, Finish, InferenceEvent

# KEYS: (lease, stream) per request.
# ARGV: maxlen, ttl, then per request: attempt, event count, and per event:
#   final flag ("1" for Finish/Error), field count n, then n field/value pairs.
# A current lease is kept alive as long as a finished stream, so it outlives
# any generation that keeps writing; a final event starts the stream's expiry.
# Returns the 1-based indexes of the requests whose lease is not their attempt.
_PUBLISH_SCRIPT = """
local maxlen, ttl = ARGV[1], ARGV[2]
local fenced = {}
local pos = 3
for i = 1, #KEYS, 2 do
  local attempt, count = ARGV[pos], tonumber(ARGV[pos + 1])
  pos = pos + 2
  local current = redis.call('GET', KEYS[i]) == attempt
  if current then
    redis.call('EXPIRE', KEYS[i], ttl)
  else
    fenced[#fenced + 1] = (i + 1) / 2
  end
  for _ = 1, count do
    local final, nfields = ARGV[pos], tonumber(ARGV[pos + 1])
    if current then
      local entry = {'XADD', KEYS[i + 1], 'MAXLEN', '~', maxlen, '*'}
      for f = pos + 2, pos + 1 + 2 * nfields do
        entry[#entry + 1] = ARGV[f]
      end
      redis.call(unpack(entry))
      if final == '1' then
        redis.call('EXPIRE', KEYS[i + 1], ttl)
      end
    end
    pos = pos + 2 + 2 * nfields
  end
end
return fenced
"""


@dataclass(slots=True)
class Batch:
    """One request's events from one step, written under ``attempt``."""

    request_id: str
    attempt: int
    events: list[InferenceEvent] = field(default_factory=list)


class EventPublisher:
    """Writes batches of events through the fencing script.

    The script is registered once; redis-py sends it by SHA and reloads it
    when the server has forgotten it (after a restart). Redis errors are the
    caller's to handle: they mean nothing of that call was written.
    """

    def __init__(
        self,
        client: redis.Redis,
        maxlen: int = keys.EVENT_STREAM_MAXLEN,
        finished_ttl_s: int = keys.FINISHED_STREAM_TTL_S,
    ) -> None:
        self._script = client.register_script(_PUBLISH_SCRIPT)
        self._maxlen = maxlen
        self._finished_ttl_s = finished_ttl_s

    def publish(self, batches: Sequence[Batch]) -> set[tuple[str, int]]:
        """Write every batch in one round trip; return the (request id, attempt)s fenced out."""
        batches = [batch for batch in batches if batch.events]
        if not batches:
            return set()
        script_keys: list[str] = []
        args: list[str | int] = [self._maxlen, self._finished_ttl_s]
        for batch in batches:
            script_keys += [keys.lease(batch.request_id), keys.event_stream(batch.request_id)]
            args += [str(batch.attempt), len(batch.events)]
            for event in batch.events:
                fields = encode_event(event, batch.attempt)
                args += ["1" if isinstance(event, Finish | Error) else "0", len(fields)]
                for name, value in fields.items():
                    args += [name, value]
        fenced = self._script(keys=script_keys, args=args)
        return {
            (batches[int(index) - 1].request_id, batches[int(index) - 1].attempt)
            for index in fenced
        }
