"""``pytest -n`` hands each shared room to one process whole, and each other module whole.

A small suite of the same layout runs under xdist with this suite's scheduler
(``tests/conftest.py``); every test writes down which process ran it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = """
import os, time

def record(name):
    with open(os.environ["ROOMS_LOG"], "a") as log:
        log.write(f"{__name__}.{name} {os.environ['PYTEST_XDIST_WORKER']}\\n")

def test_one():
    time.sleep(0.2)
    record("one")

def test_two():
    time.sleep(0.2)
    record("two")
"""
FILES = ["e2e/test_a.py", "e2e/test_b.py", "jobs/test_c.py", "test_d.py", "engine/test_e.py"]


def test_a_room_runs_in_one_process_and_a_module_stays_whole(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    for name in FILES:
        (suite / name).parent.mkdir(parents=True, exist_ok=True)
        (suite / name).write_text(TEST)
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_xdist_make_scheduler  # noqa: F401\n"
    )
    log = tmp_path / "ran.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ROOMS_LOG": str(log)}
    command = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, "--rootdir", str(tmp_path), str(suite)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    processes: dict[str, set[str]] = defaultdict(set)
    for line in log.read_text().splitlines():
        test, process = line.split()
        module = test.rsplit(".", 1)[0]
        unit = "e2e" if module in ("test_a", "test_b") else module
        processes[unit].add(process)
    assert sorted(processes) == ["e2e", "test_c", "test_d", "test_e"]
    assert all(len(ran_in) == 1 for ran_in in processes.values()), processes
    assert len(set.union(*processes.values())) == 2  # the other units went to the other one
