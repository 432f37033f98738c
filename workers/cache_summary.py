"""The worker's cache summary: the prefix block hashes its engine holds, mirrored in Redis.

The API places a request on the worker whose cache holds the longest part
of its prompt (``api.backends.placement``), reading each worker's summary
(``keys.cache_summary``: a set of 16-byte block digests) with one
``SMISMEMBER``. The engine thread hands over each step's changes (``note``,
a few set operations); this module's thread writes them, everything that
accumulated during the write in flight going in the next one, so the
summary trails the cache by about a round trip and the engine never waits
for Redis. A write that fails, and a summary Redis no longer has (it
expired or Redis restarted: the heartbeat finds out), lead to one write of
the whole mirror.

A set, not a sorted set scored by last use or a Bloom filter: the engine
already bounds it (one member per cached block), a set costs the least
memory per member and the least per update of the three that can drop a
member, and a Bloom filter cannot drop one (``python -m bench.routing``
prints the figures).
"""

from __future__ import annotations

import logging
import threading

import redis

from engine.block_manager import CacheChanges
from shared import keys
from shared.prefix_hash import digest

log = logging.getLogger(__name__)

SUMMARY_TTL_S = 30  # renewed by every heartbeat; the key of a worker nobody reclaimed goes
WRITE_CHUNK = 4096  # members per SADD in a whole write
RETRY_S = 1.0


class CacheSummary:
    """Mirrors the engine's cached hashes into Redis; see the module docstring."""

    def __init__(self, client: redis.Redis, worker_id: str) -> None:
        self._client = client
        self.key = keys.cache_summary(worker_id)
        self._held: set[int] = set()  # every hash the engine holds, as of the last ``note``
        self._pending = CacheChanges()
        self._whole = True  # the next write replaces the summary with ``_held``
        self._stopping = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="sluice-cache-summary", daemon=True)

    @property
    def size(self) -> int:
        """Hashes in the summary once the writes in flight land."""
        return len(self._held)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def note(self, changes: CacheChanges) -> None:
        """The engine's changes since its last ``note`` (engine thread; never blocks on Redis)."""
        if not changes:
            return
        with self._wake:
            for block_hash in changes.dropped:
                self._held.discard(block_hash)
                self._pending.drop(block_hash)
            for block_hash in changes.added:
                self._held.add(block_hash)
                self._pending.add(block_hash)
            self._wake.notify_all()

    def rewrite(self) -> None:
        """Write the whole mirror next: Redis no longer holds the summary."""
        with self._wake:
            self._whole = True
            self._wake.notify_all()

    def _run(self) -> None:
        while (write := self._next()) is not None:
            whole, members, dropped = write
            try:
                self._write(whole, members, dropped)
            except redis.RedisError as exc:
                log.warning("writing the cache summary failed, to rewrite: %s", exc)
                self.rewrite()
                with self._wake:
                    self._wake.wait_for(lambda: self._stopping, timeout=RETRY_S)

    def _next(self) -> tuple[bool, list[bytes], list[bytes]] | None:
        """The next write: whether it is whole, the members to add and those to remove."""
        with self._wake:
            self._wake.wait_for(lambda: self._stopping or self._whole or bool(self._pending))
            if self._stopping:
                return None
            whole, self._whole = self._whole, False
            pending, self._pending = self._pending, CacheChanges()
            added = self._held if whole else pending.added
            return whole, [digest(h) for h in added], [digest(h) for h in pending.dropped]

    def _write(self, whole: bool, members: list[bytes], dropped: list[bytes]) -> None:
        pipe = self._client.pipeline(transaction=True)
        if whole:
            pipe.delete(self.key)
        elif dropped:
            pipe.srem(self.key, *dropped)
        for start in range(0, len(members), WRITE_CHUNK):
            pipe.sadd(self.key, *members[start : start + WRITE_CHUNK])
        pipe.expire(self.key, SUMMARY_TTL_S)
        pipe.execute()
