"""A serving process's memory: its startup heap kept off the garbage collector, the collector
paused while a large request's objects are built, its free memory and the library code only its
start ran handed back.

What a server builds before its first request (torch, the model, the
tokenizer, Celery or FastAPI and everything they import) lives until the
process exits: some 200,000 objects for the imports alone, which CPython's
oldest generation walks on every full collection. Under load those
collections stop every thread of the process for tens of milliseconds, long
enough to stall every stream of a burst at once (figures: the README's
benchmark section).
``gc.freeze`` moves what exists now into a generation the collector never
scans, so a full collection only walks what serving itself allocated.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect the startup garbage, then freeze the rest; returns how many objects were frozen.

    Call it once the process has built what it keeps for its lifetime.
    Collecting first keeps startup garbage from being frozen (a frozen
    object is never freed).
    """
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze the startup heap: %d objects the collector no longer scans", frozen)
    return frozen


_pauses = 0
_pauses_lock = threading.Lock()
_was_enabled = True


@contextmanager
def paused_collection() -> Iterator[None]:
    """The cyclic collector paused while the block runs (in any thread; pauses nest and overlap).

    For work that builds many objects it keeps until it ends: parsing a
    16 MiB batch of 100,000 requests makes about 2 million. A full collection
    then runs each time their number grows by a quarter, walks them all and
    frees none, holding the interpreter (so the event loop) for 50-250 ms a
    time, a dozen times. Paused, the collector waits for the work, which frees
    what it built by reference counting when it ends; the collector resumes
    when the last overlapping pause ends, as it was before the first.
    """
    global _pauses, _was_enabled
    with _pauses_lock:
        if _pauses == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pauses_lock:
            _pauses -= 1
            if _pauses == 0 and _was_enabled:
                gc.enable()


def return_free_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``).

    Loading a model frees far more than it keeps: a GGUF tensor is dequantized
    to float32, cast, then quantized again, one at a time. glibc keeps freed
    blocks below its mmap threshold for reuse, so without a trim a server held
    about 450 MB it would never use again. Elsewhere it does nothing.
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the symbols already loaded: no library lookup
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


MADV_DONTNEED = 4
SMAPS = Path("/proc/self/smaps")
STARTUP_CODE = ("libtorch_cpu.so",)
"""Libraries whose start runs far more of their code than serving does."""
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \S+ *(\S.*)?$")


def drop_code_pages() -> int:
    """Unmap the code pages of ``STARTUP_CODE`` this process holds; returns how many KiB it dropped.

    Importing torch runs static initializers spread over libtorch's code,
    which leaves 60-110 MiB of it resident (more when the page cache holds
    more of the file), of which serving runs about 25. Code pages are clean
    copies of their file: ``MADV_DONTNEED`` takes them out of this process's
    resident set, and the ones it runs again fault back from the page cache
    (minor faults, no disk read). Only executable mappings none of whose
    pages were written (no ``Anonymous`` pages, so nothing private is lost)
    are dropped. Dropping every library's code, the interpreter's and the
    kernels' included, cost about 7% of a 32-stream burst's throughput on the
    AMD EPYC VM (four alternated runs each); libtorch's alone cost nothing
    measurable. Call it once the process has loaded and warmed up what it
    serves; the libraries stay loaded. Elsewhere than Linux it does nothing.
    """
    if not sys.platform.startswith("linux"):
        return 0
    try:
        mappings = _clean_code_mappings(SMAPS.read_text(), STARTUP_CODE)
    except OSError:  # no /proc: nothing is dropped
        return 0
    madvise = ctypes.CDLL(None).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    dropped = 0
    for start, end, resident in mappings:
        if madvise(start, end - start, MADV_DONTNEED) == 0:
            dropped += resident
    log.info("unmapped %d MiB of library code pages the start left resident", dropped >> 10)
    return dropped


def _clean_code_mappings(smaps: str, libraries: tuple[str, ...]) -> list[tuple[int, int, int]]:
    """(start, end, resident KiB) of each ``r-xp`` mapping of ``libraries`` with no written
    page."""
    found: list[tuple[int, int, int]] = []
    span: tuple[int, int] | None = None
    resident = 0
    for line in smaps.splitlines():
        if header := _MAPPING.match(line):
            start, end, permissions, path = header.groups()
            code = permissions == "r-xp" and path is not None and Path(path).name in libraries
            span = (int(start, 16), int(end, 16)) if code else None
        elif span is not None:
            field, _, value = line.partition(":")
            if field == "Rss":
                resident = int(value.split()[0])
            elif field == "Anonymous" and resident > 0 and int(value.split()[0]) == 0:
                found.append((*span, resident))  # no page written: the file holds them all
    return found
