"""A serving process's startup heap: kept off the garbage collector, its free memory returned.

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
