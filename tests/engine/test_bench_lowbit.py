"""``bench.lowbit`` times every projection of the default model against PyTorch's kernel."""

from __future__ import annotations

import pytest

from bench import lowbit
from engine.model import vnni_gemm


def test_it_prints_each_projection_beside_pytorchs_kernel(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert lowbit.main(["--rows", "2", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == [name.split()[0] for name in lowbit.SHAPES]
    for row in rows:
        pytorch, ours, ratio = float(row[3]), float(row[4]), row[5]
        assert pytorch > 0
        if vnni_gemm.available():
            assert ours > 0 and float(ratio.removesuffix("x")) > 0
