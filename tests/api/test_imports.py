"""Embedded mode loads no store or HTTP client: each costs resident memory it never uses."""

from __future__ import annotations

import subprocess
import sys

from api.store_errors import store_errors

_CHECK = """
import sys
from api.app import create_app
from api.settings import Settings
create_app(Settings())
print(sorted(name for name in ("redis", "httpx") if name in sys.modules))
"""


def test_an_embedded_app_loads_neither_redis_nor_httpx() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_store_errors_catch_a_redis_failure_once_redis_is_loaded() -> None:
    from redis.exceptions import ConnectionError as RedisConnectionError

    try:
        raise RedisConnectionError("gone")
    except store_errors() as exc:
        assert isinstance(exc, RedisConnectionError)
    assert OSError in store_errors()
