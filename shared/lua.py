"""Redis Lua scripts: every one a file in the ``scripts/`` folder of the package that owns it.

``load(package, name, *preludes)`` reads ``<package>/scripts/<name>.lua`` once, with the
sources of its preludes in front: scripts whose file only defines local functions that
several scripts share (``workers/broker/scripts/restore_records.lua``,
``api/scripts/rate_limit.lua``). Values a script needs from Python come as ``ARGV``; no file
is a template.

A script runs one way, redis-py's: ``bind(client)`` gives the client's script object
(``register_script``). Called, it sends ``EVALSHA`` and, when Redis answers NOSCRIPT (its
first call, or a Redis that restarted), loads the source and sends it again; called with a
pipeline as its client, it has the pipeline load what Redis lacks before it executes. Code
that writes commands on a connection of its own sends ``EVALSHA`` with ``sha`` and, after a
NOSCRIPT, ``source``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, overload

if TYPE_CHECKING:
    import redis
    import redis.asyncio
    from redis.commands.core import AsyncScript, Script

FOLDER = "scripts"


@dataclass(frozen=True, slots=True)
class LuaScript:
    """A script's whole source (preludes included) and its SHA-1, which ``EVALSHA`` names."""

    name: str  # ``<package>:<file name without .lua>``
    source: str
    files: tuple[str, ...] = ()  # the files the source joins, as ``api/scripts/rate_limit.lua``
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())

    @overload
    def bind(self, client: redis.asyncio.Redis) -> AsyncScript: ...

    @overload
    def bind(self, client: redis.Redis) -> Script: ...

    def bind(self, client: redis.Redis | redis.asyncio.Redis) -> Script | AsyncScript:
        """redis-py's callable script on ``client`` (a pipeline too): run by SHA, the source
        sent on NOSCRIPT; awaited on an asyncio client."""
        return client.register_script(self.source)


def load(package: str, name: str, *preludes: LuaScript) -> LuaScript:
    """``<package>/scripts/<name>.lua`` with the preludes' sources in front, in order."""
    source = "\n".join([*(prelude.source for prelude in preludes), _read(package, name)])
    file = "/".join([*package.split("."), FOLDER, f"{name}.lua"])
    files = tuple(part for prelude in preludes for part in prelude.files)
    return LuaScript(f"{package}:{name}", source, (*files, file))


@cache
def _read(package: str, name: str) -> str:
    """A script file's text, read once however many scripts use it."""
    return resources.files(package).joinpath(FOLDER, f"{name}.lua").read_text(encoding="utf-8")
