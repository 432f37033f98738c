"""bench.admission runs and prints its rows and its goal."""

from __future__ import annotations

import pytest

from bench.admission import main


def test_the_bench_prints_each_row_and_the_goal(capsys: pytest.CaptureFixture[str]):
    assert main(["--requests", "200", "--redis", "redis://127.0.0.1:6379/0"]) == 0
    out = capsys.readouterr().out
    rows = ("no key check", "API key (100 keys)", "rate limit, memory", "rate limit, Redis",
            "submit, no key", "submit with a key's share")  # fmt: skip
    for row in rows:
        assert row in out
    assert "goal <= 200 us" in out and "added by a key's share to a distributed submission" in out
