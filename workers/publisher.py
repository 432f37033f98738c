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
from dataclasses import dataclass

import redis

from shared import keys
from shared.event_codec import encode_event
from shared.events import Error, Finish, InferenceEvent

# KEYS: the model's in-flight set, then (lease, stream) per request.
# ARGV: maxlen, ttl, "1" if this write may repeat one that already ran,
#   REFRESH_EVERY, then per request: attempt, the first event's sequence
#   number, event count, its id if the events end it (else ""), and per
#   event: field count n, then n field/value pairs.
# A current lease and its stream get the time to live of a finished stream
# when an attempt starts writing, every REFRESH_EVERY events and at the end
# (not at every write, which would double the script's cost), so both
# outlive any generation that keeps writing and a stream whose writer died
# expires on its own. A repeated write (sent again after its reply was lost) skips the events the
# stream's last entry says this attempt already wrote. A request's end takes
# it out of the in-flight set, as its API does when it reads the end: an API
# that died would leave it counted against the model's bound until its
# deadline. Returns the 1-based indexes of the requests whose lease is not
# their attempt.
REFRESH_EVERY = 64
_PUBLISH_SCRIPT = """
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
"""


@dataclass(slots=True)
class Batch:
    """One request's events from one step, written under ``attempt``.

    ``seq`` is the first event's sequence number within the attempt (from
    1); the rest follow it one by one.
    """

    request_id: str
    attempt: int
    seq: int
    events: list[InferenceEvent]


Attempt = tuple[str, int]  # (request id, attempt)
WRITER_NAME = "sluice-events"  # CLIENT LIST name of ``connection()``s


class EventPublisher:
    """Writes batches of events through the fencing script.

    The script is registered once and sent by SHA; a server that has
    forgotten it (after a restart) gets it again. Redis errors are the
    caller's to handle: they mean nothing of that call was written.

    ``publish`` is one blocking call. ``send`` and ``receive`` split it in
    two over a connection of the caller's own (``connection``), so that one
    thread can send a write and another read its reply.
    """

    def __init__(
        self,
        client: redis.Redis,
        model: str,
        maxlen: int = keys.EVENT_STREAM_MAXLEN,
        ttl_s: int = keys.FINISHED_STREAM_TTL_S,
    ) -> None:
        self._client = client
        self._script = client.register_script(_PUBLISH_SCRIPT)
        self._inflight = keys.inflight(model)
        self._maxlen = maxlen
        self._ttl_s = ttl_s

    def publish(self, batches: Sequence[Batch]) -> set[Attempt]:
        """Write every batch in one round trip; return the (request id, attempt)s fenced out."""
        batches = [batch for batch in batches if batch.events]
        if not batches:
            return set()
        # The client retries a call whose connection failed, reply lost or not.
        script_keys, args = self._arguments(batches, repeated=True)
        return _fenced(batches, self._script(keys=script_keys, args=args))

    def connection(self) -> redis.Connection:
        """A connection outside the client's pool, for ``send`` and ``receive``."""
        pool = self._client.connection_pool
        return pool.connection_class(**{**pool.connection_kwargs, "client_name": WRITER_NAME})

    def send(
        self,
        connection: redis.Connection,
        batches: Sequence[Batch],
        *,
        check_health: bool = True,
        repeated: bool = False,
    ) -> None:
        """Send the write of ``batches`` (with events); ``receive`` reads its reply.

        ``check_health=False`` skips redis-py's ping of a connection idle for
        longer than its health-check interval (a round trip, or a reconnect).
        ``repeated`` says the same write may have run already (its reply was
        lost): the script then skips the events the streams already hold.
        """
        self._send(connection, "EVALSHA", self._script.sha, batches, check_health, repeated)

    def receive(self, connection: redis.Connection, batches: Sequence[Batch]) -> set[Attempt]:
        """The reply to ``send(connection, batches)``: the attempts fenced out."""
        try:
            reply = connection.read_response()
        except redis.exceptions.NoScriptError:  # nothing was written: send the script itself
            self._send(connection, "EVAL", self._script.script, batches, False, True)
            reply = connection.read_response()
        return _fenced(batches, reply)

    def _send(
        self,
        connection: redis.Connection,
        command: str,
        script: str,
        batches: Sequence[Batch],
        check_health: bool,
        repeated: bool,
    ) -> None:
        script_keys, args = self._arguments(batches, repeated)
        connection.send_command(
            command, script, len(script_keys), *script_keys, *args, check_health=check_health
        )

    def _arguments(
        self, batches: Sequence[Batch], repeated: bool
    ) -> tuple[list[str], list[str | int]]:
        script_keys: list[str] = [self._inflight]
        args: list[str | int] = [self._maxlen, self._ttl_s, "1" if repeated else "0", REFRESH_EVERY]
        for batch in batches:
            script_keys += [keys.lease(batch.request_id), keys.event_stream(batch.request_id)]
            final = batch.events and isinstance(batch.events[-1], Finish | Error)
            ends = batch.request_id if final else ""
            args += [str(batch.attempt), batch.seq, len(batch.events), ends]
            for seq, event in enumerate(batch.events, batch.seq):
                fields = encode_event(event, batch.attempt, seq)
                args.append(len(fields))
                for name, value in fields.items():
                    args += [name, value]
        return script_keys, args


def _fenced(batches: Sequence[Batch], indexes: list[int]) -> set[Attempt]:
    """The attempts of the script's 1-based request indexes."""
    return {(batches[int(i) - 1].request_id, batches[int(i) - 1].attempt) for i in indexes}
