"""Builds and loads the engine's C++ kernels, custom ops under ``torch.ops.sluice``.

Each kernel is one C++ source compiled for this machine on first use (about
9 s) with PyTorch's extension builder and kept under
``CACHE_DIR/kernels/<key>``, the key hashing the source, the engine's shared
headers, the flags and PyTorch's version. Each build runs in a directory of its own and is renamed
into place, so processes starting together never wait on one another's lock. Within a
process a library is loaded once: engines starting together on threads of one process (a
server of several models) wait for the first, since a library's ops register only once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from engine import CACHE_DIR
from shared.cpu import cpu_flags

log = logging.getLogger(__name__)

INCLUDE = Path(__file__).parent
HEADERS = sorted(INCLUDE.glob("*.h"))
"""What the kernels share (``simd16.h``): part of every kernel's key, so a change rebuilds them."""

_loading = threading.Lock()
_loaded: set[str] = set()  # the names of the libraries this process has loaded


def runs(name: str, source: Path, flags: Sequence[str], needs: Sequence[str], instead: str) -> bool:
    """Whether ``source``'s kernels run here: the CPU has the ``needs`` flags and the library
    loads, built first if no process has. A failed build (no compiler, no ninja, a full
    disk) is logged, with what serves ``instead``."""
    if not set(needs) <= cpu_flags():
        return False
    try:
        load(name, source, flags)
    except Exception as error:
        log.warning("%s is unavailable, %s serves instead: %s", name, instead, error)
        return False
    return True


def load(name: str, source: Path, flags: Sequence[str]) -> None:
    """Load ``source``'s shared library, compiling it first if no process has.

    Raises when it cannot be built (no compiler, no ninja, a full disk).
    """
    with _loading:
        if name not in _loaded:
            _load(name, source, flags)
            _loaded.add(name)


def _load(name: str, source: Path, flags: Sequence[str]) -> None:
    digest = hashlib.blake2b(digest_size=12)
    for code in (source, *HEADERS):
        digest.update(code.read_bytes())
    digest.update(repr((tuple(flags), torch.__version__)).encode())
    built = Path(CACHE_DIR) / "kernels" / digest.hexdigest()
    library = built / f"{name}.so"
    if library.is_file():
        torch.ops.load_library(str(library))
        return
    import ninja  # the build tool, installed with the project
    from torch.utils import cpp_extension  # imports setuptools: only when compiling

    os.environ["PATH"] = os.pathsep.join((ninja.BIN_DIR, os.environ.get("PATH", "")))

    built.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=built.parent, prefix=f"{built.name}."))
    try:
        cpp_extension.load(  # compiles and loads
            name,
            [str(source)],
            extra_cflags=list(flags),
            extra_include_paths=[str(INCLUDE)],
            extra_ldflags=["-fopenmp"],
            build_directory=str(staging),
            is_python_module=False,
        )
        staging.rename(built)
    except OSError:
        if not library.is_file():  # not a rival's rename that won
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone if renamed; the loaded copy stays mapped
