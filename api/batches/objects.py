"""Where files and batches live: JSON records by kind, with an optional blob each.

Every record says until when it is kept (``kept_until``, unix seconds; None:
until deleted), whom it belongs to (``owner``) and when it was made
(``created_at``).

Files and batches need less than jobs (no event stream): a record per
object, a file's content, listing newest first per owner, expiry, and (for
batches, in distributed mode) a runner lease so that another API replica
takes over a batch whose replica stopped. ``MemoryObjects`` keeps them in
this process (embedded mode, lost on restart); ``RedisObjects`` keeps them
in Redis, shared by the replicas:

- ``sluice:<kind>:<id>`` — hash: ``record`` (JSON) and ``blob`` (bytes),
  expiring with the object.
- ``sluice:<kind>:index`` — sorted set of ids by creation time.
- ``sluice:<kind>:active`` — set of unfinished ids (batches), for takeover.
- ``sluice:<kind>:<id>:runner`` — the runner lease: holder id, short TTL.

A file's content is one Redis value, so files are bounded (``--max-file-bytes``)
and so is each key's total (``--max-file-bytes-per-key``): Redis holds them in
memory.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

PREFIX = "sluice"
LIST_BATCH = 100


class ObjectStore(Protocol):
    shared: bool

    async def put(
        self, kind: str, object_id: str, record: dict[str, Any], blob: bytes | None = None
    ) -> None:
        """Save a new object; ``record`` holds ``created_at``, ``kept_until`` and ``owner``."""
        ...

    async def update(self, kind: str, object_id: str, record: dict[str, Any]) -> None: ...

    async def get(self, kind: str, object_id: str) -> dict[str, Any] | None: ...

    async def blob(self, kind: str, object_id: str) -> bytes | None: ...

    async def delete(self, kind: str, object_id: str) -> bool: ...

    async def list(
        self, kind: str, owner: str | None, limit: int, after: str | None
    ) -> tuple[list[dict[str, Any]], bool]:
        """The owner's objects, newest first, after ``after``; and whether more follow."""
        ...

    async def set_active(self, kind: str, object_id: str, active: bool) -> None: ...

    async def active(self, kind: str) -> list[str]: ...

    async def claim(self, kind: str, object_id: str, holder: str, ttl_s: float) -> bool:
        """Take (or keep, renewing it) the object's runner lease."""
        ...

    async def close(self) -> None: ...


def visible(record: dict[str, Any], owner: str | None) -> bool:
    """Objects made without a key are everyone's; others are their key's."""
    return record.get("owner") is None or record.get("owner") == owner


def _live(record: dict[str, Any]) -> bool:
    kept_until = record.get("kept_until")
    return kept_until is None or time.time() < kept_until


@dataclass(slots=True)
class _Kept:
    record: dict[str, Any]
    blob: bytes | None = None
    holder: tuple[str, float] | None = None  # (holder, lease deadline)


@dataclass
class MemoryObjects:
    """Objects in this process's memory: embedded mode, one process, lost on restart."""

    shared = False
    _objects: dict[str, dict[str, _Kept]] = field(default_factory=dict)
    _active: dict[str, set[str]] = field(default_factory=dict)

    async def put(
        self, kind: str, object_id: str, record: dict[str, Any], blob: bytes | None = None
    ) -> None:
        self._sweep(kind)
        self._objects.setdefault(kind, {})[object_id] = _Kept(dict(record), blob)

    async def update(self, kind: str, object_id: str, record: dict[str, Any]) -> None:
        kept = self._objects.get(kind, {}).get(object_id)
        if kept is not None:
            kept.record = dict(record)

    async def get(self, kind: str, object_id: str) -> dict[str, Any] | None:
        kept = self._objects.get(kind, {}).get(object_id)
        return dict(kept.record) if kept is not None and _live(kept.record) else None

    async def blob(self, kind: str, object_id: str) -> bytes | None:
        kept = self._objects.get(kind, {}).get(object_id)
        return kept.blob if kept is not None and _live(kept.record) else None

    async def delete(self, kind: str, object_id: str) -> bool:
        self._active.get(kind, set()).discard(object_id)
        return self._objects.get(kind, {}).pop(object_id, None) is not None

    async def list(
        self, kind: str, owner: str | None, limit: int, after: str | None
    ) -> tuple[list[dict[str, Any]], bool]:
        ids = list(reversed(self._objects.get(kind, {})))
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        found = []
        for object_id in ids:
            record = await self.get(kind, object_id)
            if record is not None and visible(record, owner):
                found.append(record)
                if len(found) > limit:
                    break
        return found[:limit], len(found) > limit

    async def set_active(self, kind: str, object_id: str, active: bool) -> None:
        ids = self._active.setdefault(kind, set())
        if active:
            ids.add(object_id)
        else:
            ids.discard(object_id)

    async def active(self, kind: str) -> list[str]:
        return sorted(self._active.get(kind, set()))

    async def claim(self, kind: str, object_id: str, holder: str, ttl_s: float) -> bool:
        kept = self._objects.get(kind, {}).get(object_id)
        if kept is None:
            return False
        now = time.monotonic()
        if kept.holder is not None and kept.holder[0] != holder and kept.holder[1] > now:
            return False
        kept.holder = (holder, now + ttl_s)
        return True

    async def close(self) -> None:
        return None

    def _sweep(self, kind: str) -> None:
        objects = self._objects.get(kind, {})
        for object_id in [i for i, kept in objects.items() if not _live(kept.record)]:
            del objects[object_id]


# KEYS: lease. ARGV: holder, ttl ms. Takes a free lease or renews one's own.
_CLAIM = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

_UPDATE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'record', ARGV[1])
return 1
"""


class RedisObjects:
    """The shared store: see the module docstring for its keys."""

    shared = True

    def __init__(self, redis_url: str) -> None:
        from redis.asyncio import Redis  # distributed mode only; embedded never loads it

        self._redis = Redis.from_url(redis_url, socket_timeout=30, socket_connect_timeout=2)
        self._claim = self._redis.register_script(_CLAIM)
        self._update = self._redis.register_script(_UPDATE)

    async def put(
        self, kind: str, object_id: str, record: dict[str, Any], blob: bytes | None = None
    ) -> None:
        key = _key(kind, object_id)
        mapping: dict[str, Any] = {"record": json.dumps(record)}
        if blob is not None:
            mapping["blob"] = blob
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=mapping)
            if record.get("kept_until") is not None:
                pipe.pexpireat(key, int(record["kept_until"] * 1000))
            pipe.zadd(_key(kind, "index"), {object_id: record["created_at"]})
            await pipe.execute()

    async def update(self, kind: str, object_id: str, record: dict[str, Any]) -> None:
        """Replace the record of an object that still exists (an expired one stays gone)."""
        await self._update(keys=[_key(kind, object_id)], args=[json.dumps(record)])

    async def get(self, kind: str, object_id: str) -> dict[str, Any] | None:
        raw = await self._redis.hget(_key(kind, object_id), "record")
        return json.loads(raw) if raw is not None else None

    async def blob(self, kind: str, object_id: str) -> bytes | None:
        return await self._redis.hget(_key(kind, object_id), "blob")

    async def delete(self, kind: str, object_id: str) -> bool:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(_key(kind, object_id), _key(kind, f"{object_id}:runner"))
            pipe.zrem(_key(kind, "index"), object_id)
            pipe.srem(_key(kind, "active"), object_id)
            deleted, *_ = await pipe.execute()
        return bool(deleted)

    async def list(
        self, kind: str, owner: str | None, limit: int, after: str | None
    ) -> tuple[list[dict[str, Any]], bool]:
        index = _key(kind, "index")
        start = 0
        if after is not None:
            rank = await self._redis.zrevrank(index, after)
            if rank is None:
                return [], False
            start = rank + 1
        found: list[dict[str, Any]] = []
        while len(found) <= limit:
            ids = [
                i.decode()
                for i in await self._redis.zrevrange(index, start, start + LIST_BATCH - 1)
            ]
            if not ids:
                break
            start += len(ids)
            async with self._redis.pipeline(transaction=False) as pipe:
                for object_id in ids:
                    pipe.hget(_key(kind, object_id), "record")
                replies = await pipe.execute()
            gone = [i for i, raw in zip(ids, replies, strict=True) if raw is None]
            if gone:
                await self._redis.zrem(index, *gone)
            for raw in replies:
                record = json.loads(raw) if raw is not None else None
                if record is not None and visible(record, owner):
                    found.append(record)
        return found[:limit], len(found) > limit

    async def set_active(self, kind: str, object_id: str, active: bool) -> None:
        if active:
            await self._redis.sadd(_key(kind, "active"), object_id)
        else:
            await self._redis.srem(_key(kind, "active"), object_id)

    async def active(self, kind: str) -> list[str]:
        return sorted(i.decode() for i in await self._redis.smembers(_key(kind, "active")))

    async def claim(self, kind: str, object_id: str, holder: str, ttl_s: float) -> bool:
        lease = _key(kind, f"{object_id}:runner")
        return bool(await self._claim(keys=[lease], args=[holder, int(ttl_s * 1000)]))

    async def close(self) -> None:
        await self._redis.aclose()


def _key(kind: str, name: str) -> str:
    return f"{PREFIX}:{kind}:{name}"


__all__ = ["MemoryObjects", "ObjectStore", "RedisObjects", "visible"]
