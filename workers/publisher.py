"""Fenced event publishing: a stale attempt's writes never reach a stream.

A request can have two live writers: a worker that lost its broker
connection (or was merely slow) and the worker its redelivered job went to.
Each run holds an attempt number; ``lease(request_id)`` holds the current
one. One Lua script (``scripts/publish.lua``) writes a whole engine step, every request's events,
in one round trip, and checks each request's lease before its ``XADD``s, so
the check and the write are atomic on the server: a stale attempt's events
are dropped there, and the script names those requests so the worker stops
generating for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import redis

from shared import keys, lua
from shared.event_codec import encode_event
from shared.events import Error, Finish, InferenceEvent

REFRESH_EVERY = 64  # the events between refreshes of a stream's time to live (publish.lua)
PUBLISH = lua.load("workers", "publish")


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
        self._script = PUBLISH.bind(client)
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
        self._send(connection, "EVALSHA", PUBLISH.sha, batches, check_health, repeated)

    def receive(self, connection: redis.Connection, batches: Sequence[Batch]) -> set[Attempt]:
        """The reply to ``send(connection, batches)``: the attempts fenced out."""
        try:
            reply = connection.read_response()
        except redis.exceptions.NoScriptError:  # nothing was written: send the script itself
            self._send(connection, "EVAL", PUBLISH.source, batches, False, True)
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
