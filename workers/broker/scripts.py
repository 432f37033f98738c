"""The broker's Lua scripts: read from ``scripts/*.lua`` once, called by SHA.

``restore_records.lua`` is a function the scripts that put messages back
share, and ``own_queue.lua`` one the scripts that hand a worker's own queue
back share; each is prepended to the scripts that use it. A script Redis does not know yet
(its first call, or a Redis that restarted) is sent whole once with
``EVAL``, which also caches it for the next ``EVALSHA``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

FOLDER = Path(__file__).with_name("scripts")


@dataclass(frozen=True, slots=True)
class LuaScript:
    name: str
    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())

    def __call__(self, client: redis.Redis, keys: list[str], args: list[Any]) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            return client.eval(self.source, len(keys), *keys, *args)


def _load(name: str, *preludes: str) -> LuaScript:
    parts = [(FOLDER / f"{part}.lua").read_text() for part in (*preludes, name)]
    return LuaScript(name, "\n".join(parts))


TAKE = _load("take")
RESTORE = _load("restore", "restore_records")
BEAT = _load("beat", "restore_records", "own_queue")
LEAVE = _load("leave", "restore_records", "own_queue")
