"""The structured-outputs benchmark runs end to end with tiny settings and prints every row."""

from __future__ import annotations

import re

import pytest
import torch

from bench import structured
from shared.constraints import schema_is_enforceable


def test_the_benchmark_schema_is_enforced_in_full():
    assert schema_is_enforceable(structured.schema())
    assert structured.schema("other")["required"][0] == "other"


def test_percentile_is_nearest_rank():
    assert [structured.percentile(list(range(1, 101)), p) for p in (50, 99)] == [50, 99]
    assert structured.percentile([7.0], 99) == 7.0


def test_the_benchmark_prints_runs_summary_and_grammar_costs(capsys: pytest.CaptureFixture[str]):
    threads = torch.get_num_threads()
    try:
        argv = ["--requests", "2", "--new-tokens", "8", "--rounds", "1", "--schemas", "3"]
        assert structured.main([*argv, "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.splitlines()

    assert lines[0].startswith("default model, greedy, 2 concurrent chat requests")
    assert "1 torch threads" in lines[0]
    runs = lines[2:5]
    assert [line.split()[0] for line in runs] == ["1", "1", "1"]
    assert [line.split(maxsplit=1)[1][:16].strip() for line in runs] == [
        structured.UNCONSTRAINED,
        structured.CONSTRAINED,
        structured.LENGTH_MATCHED,
    ]
    # 2 requests x 8 tokens in 8 steps each way: the JSON cannot close within 8 tokens
    assert [line.split()[-7:-5] for line in runs] == [["16", "8"]] * 3
    goal = line_starting("ratio json schema / unconstrained", lines)
    assert re.search(r">= 0\.90x\s+(yes|no)\s+\d+\.\d\dx$", goal)  # one round's ratio last
    assert re.search(r"-\s+-\s+\d+\.\d\dx$", line_starting("ratio json schema / length", lines))
    assert "p50 <= 5 ms" in line_starting("compile, 3 distinct schemas", lines)
    for name in ("same schema (cache hit)", "first mask", "mask fill/step", "mask wait/step"):
        assert "nan" not in line_starting(name, lines)
    line_starting("mask apply/step", lines)


def line_starting(prefix: str, lines: list[str]) -> str:
    found = [line for line in lines if line.startswith(prefix)]
    assert len(found) == 1, f"expected one line starting {prefix!r} in {lines}"
    return found[0]
