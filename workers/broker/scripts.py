"""The broker's Lua scripts (``scripts/*.lua``), loaded through ``shared.lua``.

``restore_records.lua`` defines the function the scripts that put messages back share, and
``own_queue.lua`` the one the scripts that hand a worker's own queue back share: each is a
prelude of the scripts that use it.
"""

from __future__ import annotations

from shared import lua

PACKAGE = "workers.broker"

_RESTORE_RECORDS = lua.load(PACKAGE, "restore_records")
_OWN_QUEUE = lua.load(PACKAGE, "own_queue")

TAKE = lua.load(PACKAGE, "take")
RESTORE = lua.load(PACKAGE, "restore", _RESTORE_RECORDS)
BEAT = lua.load(PACKAGE, "beat", _RESTORE_RECORDS, _OWN_QUEUE)
LEAVE = lua.load(PACKAGE, "leave", _RESTORE_RECORDS, _OWN_QUEUE)
