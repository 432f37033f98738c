"""``freeze_startup_heap``: startup garbage is freed, the rest is out of the collector's view.
``paused_collection``: pauses nest across threads and restore the collector as they found it.
``drop_code_pages``: clean library code leaves the resident set and faults back when run."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.heap import _clean_code_mappings, freeze_startup_heap, paused_collection


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref[Node]:
    """A reference cycle nothing else refers to: only the collector can free it."""
    first, second = Node(), Node()
    first.other, second.other = second, first
    return weakref.ref(first)


@pytest.fixture(autouse=True)
def thawed() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_startup_garbage_is_collected_before_the_freeze() -> None:
    garbage = cycle()
    kept = Node()
    frozen = freeze_startup_heap()
    assert garbage() is None  # frozen garbage would never be freed
    assert 0 < gc.get_freeze_count() <= frozen  # other threads' frozen objects may die since
    assert gc.is_tracked(kept)


def test_a_full_collection_scans_only_what_came_after() -> None:
    freeze_startup_heap()
    tracked_after_freeze = len(gc.get_objects())
    later = cycle()
    assert tracked_after_freeze < gc.get_freeze_count()  # the permanent generation is not listed
    gc.collect()
    assert later() is None  # garbage made while serving is still freed


SMAPS = """\
55d0c0000000-55d0c0010000 r-xp 00004000 fe:00 260368                     /usr/bin/python3
Size:                 64 kB
Rss:                  48 kB
Anonymous:             0 kB
VmFlags: rd ex mr mw me
7f0000000000-7f0000100000 r--p 00000000 fe:00 1234                       /opt/lib/libtorch_cpu.so
Rss:                 100 kB
Anonymous:             0 kB
7f0000100000-7f0000200000 r-xp 00026000 fe:00 1234                       /opt/lib/libtorch_cpu.so
Rss:                 900 kB
Anonymous:             4 kB
7f0000200000-7f0000300000 r-xp 00000000 00:00 0
Rss:                  12 kB
Anonymous:            12 kB
7f0000300000-7f0000400000 r-xp 00010000 fe:00 1234                       /opt/lib/libtorch_cpu.so
Rss:                   0 kB
Anonymous:             0 kB
7f0000400000-7f0000500000 r-xp 00020000 fe:00 1234                       /opt/lib/libtorch_cpu.so
Rss:                2048 kB
Anonymous:             0 kB
7f0000500000-7f0000600000 r-xp 00020000 fe:00 1235                      /opt/lib/libtorch_cpu.so.1
Rss:                 512 kB
Anonymous:             0 kB
7ffd00000000-7ffd00002000 r-xp 00000000 00:00 0                          [vdso]
Rss:                   8 kB
Anonymous:             0 kB
"""


def test_only_clean_resident_code_of_the_named_libraries_is_dropped() -> None:
    """Other libraries, read-only data, code with a written page (a breakpoint, say),
    anonymous code, the vdso and mappings with nothing resident are kept."""
    assert _clean_code_mappings(SMAPS, ("libtorch_cpu.so",)) == [
        (0x7F0000400000, 0x7F0000500000, 2048)
    ]
    assert _clean_code_mappings(SMAPS, ("python3", "libtorch_cpu.so")) == [
        (0x55D0C0000000, 0x55D0C0010000, 48),
        (0x7F0000400000, 0x7F0000500000, 2048),
    ]


DROP = """
import re
import torch
from shared.heap import drop_code_pages

CODE = re.compile(r" r-xp .*libtorch_cpu.*\\n(?:.*\\n)*?Rss: +(\\d+)")

def code_kib():
    return sum(int(kib) for kib in CODE.findall(open("/proc/self/smaps").read()))

x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
before = code_kib()
dropped = drop_code_pages()
after = code_kib()
print(before, dropped, after, (x @ x.T).sum().item(), flush=True)
"""


def test_dropped_code_pages_fault_back_when_run() -> None:
    """A process that imported torch holds far less of libtorch's code once the pages are
    dropped, and still computes what it did."""
    if not Path("/proc/self/smaps").exists():
        pytest.skip("no /proc/self/smaps here")
    done = subprocess.run([sys.executable, "-c", DROP], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    before, dropped, after, total = done.stdout.split()
    assert int(dropped) >= int(before) > 1024
    assert int(after) < int(before) / 4
    assert float(total) == 1134  # the squared length of the rows' sum, (12, 15, 18, 21)


def test_the_collector_resumes_when_the_last_overlapping_pause_ends() -> None:
    assert gc.isenabled()
    entered, release = threading.Event(), threading.Event()

    def pause_elsewhere() -> None:
        with paused_collection():
            entered.set()
            release.wait(10)

    other = threading.Thread(target=pause_elsewhere)
    with paused_collection():
        other.start()
        entered.wait(10)
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's pause still holds
    release.set()
    other.join()
    assert gc.isenabled()
    gc.disable()
    try:  # a collector disabled before the first pause stays disabled after the last
        with paused_collection():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
