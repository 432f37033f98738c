"""Where files and batches live: JSON records by kind, with an optional blob each.

Every record says until when it is kept (``kept_until``, unix seconds; None:
until deleted), whom it belongs to (``owner``) and when it was made
(``created_at``).

Files and batches need less than jobs (no event stream): a record per
object, a file's content, listing newest first per owner, expiry, a quota per
owner, and (for batches, in distributed mode) a runner lease so that another
API replica takes over a batch whose replica stopped.

Each owner's objects are indexed on their own, so what one owner holds costs
nothing to another's listing or upload. A quota (``Quota``: bytes and objects)
is kept as counters that every charged write, deletion and expiry updates in
the same step, and a charged write that would pass it is refused in that step
(``QuotaExceeded``): the counters never need a listing to be right, however
many objects an owner holds. ``MemoryObjects`` keeps all of this in this
process (embedded mode, lost on restart); ``RedisObjects`` keeps it in Redis,
shared by the replicas:

- ``sluice:<kind>:<id>`` — hash: ``record`` (JSON) and ``blob`` (bytes),
  expiring with the object.
- ``sluice:<kind>:owner:<owner>`` — sorted set of the owner's ids by creation.
- ``sluice:<kind>:held:<owner>`` — hash: ``bytes`` and ``count`` charged to the
  owner, and each charged object's size under its id.
- ``sluice:<kind>:lapse:<owner>`` — sorted set of the charged ids by the time
  they stop being kept: the counters give them back once that has passed.
- ``sluice:<kind>:active`` — set of unfinished ids (batches), for takeover.
- ``sluice:<kind>:<id>:runner`` — the runner lease: holder id, short TTL.

A file's content is one Redis value, so files are bounded (``--max-file-bytes``)
and so is what each key's files hold together (``--max-file-bytes-per-key``,
``--max-files-per-key``): Redis holds them in memory.
"""

from __future__ import annotations

import heapq
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared import lua

PREFIX = "sluice"
LIST_BATCH = 100
LAPSE_BATCH = 1000  # expired charges given back per write, at most: a write stays short

Where = Callable[[dict[str, Any]], bool]


@dataclass(frozen=True, slots=True)
class Quota:
    """What one owner's charged objects of a kind may hold together."""

    bytes: int
    count: int


class QuotaExceeded(Exception):
    """A charged write that would take its owner past the quota; nothing was written."""

    def __init__(self, held_bytes: int, held_count: int, size: int, quota: Quota) -> None:
        super().__init__(f"{held_count} objects of {held_bytes} bytes held, {size} more asked")
        self.held_bytes = held_bytes
        self.held_count = held_count
        self.size = size
        self.quota = quota


class ObjectStore(Protocol):
    shared: bool

    async def put(
        self,
        kind: str,
        object_id: str,
        record: dict[str, Any],
        blob: bytes | None = None,
        quota: Quota | None = None,
    ) -> None:
        """Save a new object; ``record`` holds ``created_at``, ``kept_until`` and ``owner``.

        With ``quota`` the blob's size is charged to the owner, or ``QuotaExceeded``.
        """
        ...

    async def update(self, kind: str, object_id: str, record: dict[str, Any]) -> None: ...

    async def get(self, kind: str, object_id: str) -> dict[str, Any] | None: ...

    async def blob(self, kind: str, object_id: str) -> bytes | None: ...

    async def delete(self, kind: str, object_id: str) -> bool:
        """Forget the object (its charge goes back); whether it was there."""
        ...

    async def held(self, kind: str, owner: str | None) -> tuple[int, int]:
        """The bytes and the number of objects charged to ``owner``."""
        ...

    async def list(
        self,
        kind: str,
        owner: str | None,
        limit: int,
        after: str | None,
        *,
        ascending: bool = False,
        where: Where | None = None,
    ) -> tuple[list[dict[str, Any]], bool]:
        """The owner's objects (those ``where`` accepts), newest first unless ``ascending``,
        after ``after``; and whether more follow."""
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


@dataclass(slots=True)
class _Kept:
    """One object: its record as JSON, a snapshot no caller's later change reaches (as in
    Redis), with the fields the store itself reads."""

    text: str
    owner: str | None
    kept_until: float | None
    blob: bytes | None = None
    holder: tuple[str, float] | None = None  # (holder, lease deadline)
    charge: int | None = None  # the bytes charged to its owner, when it is charged

    @classmethod
    def of(cls, record: dict[str, Any], blob: bytes | None) -> _Kept:
        return cls(json.dumps(record), record.get("owner"), record.get("kept_until"), blob)

    @property
    def live(self) -> bool:
        return self.kept_until is None or time.time() < self.kept_until


@dataclass(slots=True)
class _Held:
    """One owner's charged objects of a kind: their bytes and their number."""

    bytes: int = 0
    count: int = 0


@dataclass
class MemoryObjects:
    """Objects in this process's memory: embedded mode, one process, lost on restart."""

    shared = False
    _objects: dict[str, dict[str, _Kept]] = field(default_factory=dict)
    _owned: dict[tuple[str, str | None], dict[str, None]] = field(default_factory=dict)
    _held: dict[tuple[str, str | None], _Held] = field(default_factory=dict)
    _lapses: dict[str, list[tuple[float, str]]] = field(default_factory=dict)  # heaps
    _active: dict[str, set[str]] = field(default_factory=dict)

    async def put(
        self,
        kind: str,
        object_id: str,
        record: dict[str, Any],
        blob: bytes | None = None,
        quota: Quota | None = None,
    ) -> None:
        self._forget_lapsed(kind)
        owner = record.get("owner")
        kept = _Kept.of(record, blob)
        if quota is not None:
            held = self._held.setdefault((kind, owner), _Held())
            size = len(blob or b"")
            if held.bytes + size > quota.bytes or held.count + 1 > quota.count:
                raise QuotaExceeded(held.bytes, held.count, size, quota)
            held.bytes, held.count, kept.charge = held.bytes + size, held.count + 1, size
        await self.delete(kind, object_id)  # a rewrite replaces it, charge and all
        self._objects.setdefault(kind, {})[object_id] = kept
        self._owned.setdefault((kind, owner), {})[object_id] = None
        if record.get("kept_until") is not None:
            heapq.heappush(self._lapses.setdefault(kind, []), (record["kept_until"], object_id))

    async def update(self, kind: str, object_id: str, record: dict[str, Any]) -> None:
        kept = self._objects.get(kind, {}).get(object_id)
        if kept is not None:
            kept.text = json.dumps(record)

    async def get(self, kind: str, object_id: str) -> dict[str, Any] | None:
        kept = self._objects.get(kind, {}).get(object_id)
        return json.loads(kept.text) if kept is not None and kept.live else None

    async def blob(self, kind: str, object_id: str) -> bytes | None:
        kept = self._objects.get(kind, {}).get(object_id)
        return kept.blob if kept is not None and kept.live else None

    async def delete(self, kind: str, object_id: str) -> bool:
        self._active.get(kind, set()).discard(object_id)
        kept = self._objects.get(kind, {}).pop(object_id, None)
        if kept is None:
            return False
        self._owned.get((kind, kept.owner), {}).pop(object_id, None)
        if kept.charge is not None:
            held = self._held[(kind, kept.owner)]
            held.bytes, held.count = held.bytes - kept.charge, held.count - 1
        return True

    async def held(self, kind: str, owner: str | None) -> tuple[int, int]:
        self._forget_lapsed(kind)
        held = self._held.get((kind, owner), _Held())
        return held.bytes, held.count

    async def list(
        self,
        kind: str,
        owner: str | None,
        limit: int,
        after: str | None,
        *,
        ascending: bool = False,
        where: Where | None = None,
    ) -> tuple[list[dict[str, Any]], bool]:
        ids = list(self._owned.get((kind, owner), {}))
        if not ascending:
            ids.reverse()
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        found = []
        for object_id in ids:
            record = await self.get(kind, object_id)
            if record is not None and (where is None or where(record)):
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

    def _forget_lapsed(self, kind: str) -> None:
        """Forget the objects no longer kept; their charges go back to their owners."""
        lapses, objects = self._lapses.get(kind, []), self._objects.get(kind, {})
        now = time.time()
        while lapses and lapses[0][0] <= now:
            _, object_id = heapq.heappop(lapses)
            kept = objects.get(object_id)
            if kept is not None and not kept.live:
                objects.pop(object_id)
                self._owned.get((kind, kept.owner), {}).pop(object_id, None)
                if kept.charge is not None:
                    held = self._held[(kind, kept.owner)]
                    held.bytes, held.count = held.bytes - kept.charge, held.count - 1


_LAPSE = lua.load("api.batches", "lapse")  # defines lapse() for the scripts that charge
_CLAIM = lua.load("api.batches", "claim")
_UPDATE = lua.load("api.batches", "update")
_PUT = lua.load("api.batches", "put", _LAPSE)
_DELETE = lua.load("api.batches", "delete")
_HELD = lua.load("api.batches", "held", _LAPSE)


class RedisObjects:
    """The shared store: see the module docstring for its keys."""

    shared = True

    def __init__(self, redis_url: str) -> None:
        from redis.asyncio import Redis  # distributed mode only; embedded never loads it

        self._redis = Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=2)
        self._claim = _CLAIM.bind(self._redis)
        self._update = _UPDATE.bind(self._redis)
        self._put = _PUT.bind(self._redis)
        self._delete = _DELETE.bind(self._redis)
        self._held = _HELD.bind(self._redis)

    async def put(
        self,
        kind: str,
        object_id: str,
        record: dict[str, Any],
        blob: bytes | None = None,
        quota: Quota | None = None,
    ) -> None:
        owner, kept_until = record.get("owner"), record.get("kept_until")
        size = len(blob or b"")
        reply = await self._put(
            keys=[_key(kind, object_id), *_owner_keys(kind, owner)],
            args=[
                object_id,
                json.dumps(record),
                record["created_at"],
                "" if kept_until is None else int(kept_until * 1000),
                blob or b"",
                size,
                -1 if quota is None else quota.bytes,
                -1 if quota is None else quota.count,
                0 if blob is None else 1,
                time.time(),
                LAPSE_BATCH,
            ],
        )
        if not int(reply[0]):
            assert quota is not None
            raise QuotaExceeded(int(reply[1]), int(reply[2]), size, quota)

    async def update(self, kind: str, object_id: str, record: dict[str, Any]) -> None:
        """Replace the record of an object that still exists (an expired one stays gone)."""
        await self._update(keys=[_key(kind, object_id)], args=[json.dumps(record)])

    async def get(self, kind: str, object_id: str) -> dict[str, Any] | None:
        raw = await self._redis.hget(_key(kind, object_id), "record")
        return json.loads(raw) if raw is not None else None

    async def blob(self, kind: str, object_id: str) -> bytes | None:
        return await self._redis.hget(_key(kind, object_id), "blob")

    async def delete(self, kind: str, object_id: str) -> bool:
        record = await self.get(kind, object_id)
        owned, held, lapsing = _owner_keys(kind, None if record is None else record.get("owner"))
        lease, active = _key(kind, f"{object_id}:runner"), _key(kind, "active")
        deleted = await self._delete(
            keys=[_key(kind, object_id), lease, active, owned, held, lapsing], args=[object_id]
        )
        return bool(deleted)

    async def held(self, kind: str, owner: str | None) -> tuple[int, int]:
        owned, held, lapsing = _owner_keys(kind, owner)
        counts = await self._held(keys=[held, lapsing, owned], args=[time.time(), LAPSE_BATCH])
        return int(counts[0]), int(counts[1])

    async def list(
        self,
        kind: str,
        owner: str | None,
        limit: int,
        after: str | None,
        *,
        ascending: bool = False,
        where: Where | None = None,
    ) -> tuple[list[dict[str, Any]], bool]:
        index = _owner_keys(kind, owner)[0]
        rank = self._redis.zrank if ascending else self._redis.zrevrank
        span = self._redis.zrange if ascending else self._redis.zrevrange
        start = 0
        if after is not None:
            at = await rank(index, after)
            if at is None:
                return [], False
            start = at + 1
        found: list[dict[str, Any]] = []
        while len(found) <= limit:
            ids = [i.decode() for i in await span(index, start, start + LIST_BATCH - 1)]
            if not ids:
                break
            start += len(ids)
            async with self._redis.pipeline(transaction=False) as pipe:
                for object_id in ids:
                    pipe.hget(_key(kind, object_id), "record")
                replies = await pipe.execute()
            gone = [i for i, raw in zip(ids, replies, strict=True) if raw is None]
            if gone:  # expired: out of the index (a charged one's charge lapses on its own)
                await self._redis.zrem(index, *gone)
                start -= len(gone)
            for raw in replies:
                record = json.loads(raw) if raw is not None else None
                if record is not None and (where is None or where(record)):
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


def _owner_keys(kind: str, owner: str | None) -> tuple[str, str, str]:
    """The owner's index, counters and lapse schedule (objects without an owner share ``-``;
    a key's name is never empty, so ``=name`` cannot meet it)."""
    name = "-" if owner is None else f"={owner}"
    return _key(kind, f"owner:{name}"), _key(kind, f"held:{name}"), _key(kind, f"lapse:{name}")


__all__ = ["MemoryObjects", "ObjectStore", "Quota", "QuotaExceeded", "RedisObjects", "visible"]
