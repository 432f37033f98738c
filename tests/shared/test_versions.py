"""The libraries whose internals the code relies on are installed at the versions it supports."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from shared import versions
from shared.versions import SUPPORTED, require, unsupported

ROOT = Path(__file__).resolve().parents[2]


def test_installed_versions_are_supported() -> None:
    assert unsupported() == [], "\n".join(unsupported())


def test_pyproject_pins_each_to_its_supported_minor() -> None:
    """The pin admits the supported minor's releases and nothing beyond them."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {Requirement(line).name: Requirement(line).specifier for line in dependencies}
    for package, minor in SUPPORTED.items():
        major, low = (int(part) for part in minor.split("."))
        spec = pins[package]
        assert spec.contains(f"{minor}.0") or spec.contains(f"{minor}.0+cpu"), package
        assert not spec.contains(f"{major}.{low + 1}.0"), f"{package} admits {major}.{low + 1}"
        assert not spec.contains(f"{major}.{low - 1}.99"), f"{package} admits {major}.{low - 1}"


def test_another_version_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "version", lambda package: "5.8.1")
    (message,) = unsupported("kombu")
    assert "kombu 5.8.1 is installed" in message and "kombu 5.7.x" in message
    with pytest.raises(RuntimeError, match="celery 5.8.1 is installed.*kombu 5.8.1 is installed"):
        require("celery", "kombu")


def test_a_local_build_tag_counts_as_its_release(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "version", lambda package: "2.13.0+cpu")
    assert unsupported("torch") == []
