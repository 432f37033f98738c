"""The installed package's version, for ``/version`` and ``sluice --version``."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    try:
        return version("sluice")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "0+unknown"
