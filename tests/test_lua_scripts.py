"""Every Redis Lua script is a packaged ``.lua`` file loaded through ``shared.lua``.

Each file in a package's ``scripts/`` folder is part of a script some module loads, wheels
carry it (``[tool.setuptools.package-data]``), Redis compiles every loaded script under the
SHA the loader computed, and no Python source holds Lua of its own or registers a script
another way.
"""

from __future__ import annotations

import importlib
import re
import tomllib
import uuid
from functools import cache
from pathlib import Path

import pytest
import redis

from shared import lua

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "workers", "shared", "engine", "bench")
REDIS_URL = "redis://127.0.0.1:6379/0"
INLINE_LUA = re.compile(r"redis\.p?call\(")
OTHER_LOADERS = re.compile(r"register_script\(|\.eval(sha)?\((?!\))")
LOADER = ROOT / "shared" / "lua.py"


def _sources() -> list[Path]:
    return [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


@cache
def _loaded_scripts() -> list[lua.LuaScript]:
    """The scripts held by every module that calls ``lua.load``."""
    owners = [path for path in _sources() if "lua.load(" in path.read_text() and path != LOADER]
    assert owners, "no module loads a script"
    scripts = []
    for path in owners:
        module = importlib.import_module(_module(path))
        scripts += [value for value in vars(module).values() if isinstance(value, lua.LuaScript)]
    return scripts


def _script_files() -> list[Path]:
    files = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.lua"))]
    assert files, "no .lua files found"
    return files


@pytest.mark.parametrize("path", _script_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_each_file_is_a_packaged_script_something_loads(path: Path) -> None:
    folder = path.parent
    assert folder.name == lua.FOLDER, f"{path} is not in a {lua.FOLDER}/ folder"
    assert (folder.parent / "__init__.py").exists(), f"{folder.parent} is not a package"
    package = _module(folder.parent / "__init__.py").removesuffix(".__init__")
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = package_data["package-data"].get(package, [])
    assert f"{lua.FOLDER}/*.lua" in globs, f"wheels leave out {path}: no package-data for it"
    name = path.relative_to(ROOT).as_posix()
    assert any(name in script.files for script in _loaded_scripts()), f"nothing loads {name}"


def test_redis_compiles_every_loaded_script() -> None:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        for script in _loaded_scripts():
            assert client.script_load(script.source) == script.sha, script.name
    finally:
        client.close()


def test_a_script_redis_does_not_know_runs_on_a_client_and_in_a_pipeline() -> None:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        for piped in (False, True):
            script = lua.LuaScript("test:echo", f"-- {uuid.uuid4()}\nreturn ARGV[1]")
            assert client.script_exists(script.sha) == [False]
            if piped:
                with client.pipeline(transaction=False) as pipe:
                    script.bind(client)(args=["piped"], client=pipe)
                    assert pipe.execute() == [b"piped"]
            else:
                assert script.bind(client)(args=["direct"]) == b"direct"
            assert client.script_exists(script.sha) == [True]
    finally:
        client.close()


def test_no_python_source_holds_lua_or_loads_it_another_way() -> None:
    found = []
    for path in _sources():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if INLINE_LUA.search(line) or (path != LOADER and OTHER_LOADERS.search(line)):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "Lua outside .lua files, or run without shared.lua:\n" + "\n".join(found)
