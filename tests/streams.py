"""Writing request event streams by hand, entry for entry as a worker writes them."""

from __future__ import annotations

import redis

from shared import keys
from shared.event_codec import decode_entry, encode_event
from shared.events import InferenceEvent


def append_events(
    client: redis.Redis,
    request_id: str,
    attempt: int,
    *events: InferenceEvent,
    seq: int | None = None,
) -> None:
    """Add ``events`` under ``attempt``, numbered on from its last entry unless ``seq`` is given."""
    stream = keys.event_stream(request_id)
    if seq is None:
        entries = client.xrange(stream)
        seq = 1 + sum(decode_entry(request_id, fields).attempt == attempt for _, fields in entries)
    for number, event in enumerate(events, seq):
        client.xadd(stream, encode_event(event, attempt, number))
