"""Half-precision CPU GEMMs run on a few row counts whatever the prompt lengths, so oneDNN's
per-shape kernels (about 1.2 MiB each, cached) stay few and the server's memory bounded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from engine import LLM, SamplingParams
from engine.model import rowwise, vnni_gemm
from engine.model.layers import gemm_rows, linear
from tests.engine.test_registry_models import make_tiny_model


def test_rows_round_up_to_a_power_of_two_then_to_a_multiple_of_the_step() -> None:
    rows = [1, 2, 3, 5, 96, 255, 256, 257, 1280, 1281, 2048]
    assert [gemm_rows(r) for r in rows] == [1, 2, 4, 8, 128, 256, 256, 512, 1280, 1536, 2048]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_padded_linear_computes_what_an_unpadded_one_does(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, weight, bias = (torch.randn(*shape, dtype=dtype) for shape in ((100, 64), (48, 64), (48,)))
    ours = linear(x, weight, bias)
    assert ours.shape == (100, 48)
    torch.testing.assert_close(ours, F.linear(x, weight, bias), rtol=2e-2, atol=2e-2)


# sluice::dense_linear is what bfloat16 layers call where the engine's kernels build.
PRODUCTS = (
    torch.ops.aten.linear.default,
    torch.ops.aten.mm.default,
    *((torch.ops.sluice.dense_linear.default,) if rowwise.available() else ()),
)


class _GemmRows(TorchDispatchMode):
    """Records the input rows of every matrix product the model runs."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in PRODUCTS:
            self.rows.add(args[0].shape[0])
        elif func is torch.ops.aten.addmm.default:
            self.rows.add(args[1].shape[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_prefills_of_many_lengths_meet_few_gemm_shapes(tmp_path: Path, quantization: str) -> None:
    weights = str(make_tiny_model(tmp_path / "tiny", hidden_size=64, intermediate_size=128))
    llm = LLM(weights, dtype="bfloat16", quantization=quantization, enforce_eager=True)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompts = [[100 + i] * length for i, length in enumerate(range(97, 300, 7))]  # 29 lengths
    with _GemmRows() as seen:
        llm.generate(prompts, params)  # each prefill alone: max_num_seqs batches them
        for prompt in prompts[:3]:
            llm.generate([prompt[:-5]], params)  # cached prefixes leave short prefills
    if quantization == "int4" and vnni_gemm.available():
        assert not seen.rows  # the VNNI kernel serves every row count: nothing is dequantized
        return
    assert seen.rows  # the model's products went through the recorder
    assert seen.rows <= {1, 2, 4, 8, 16, 32, 64, 128, 256, *range(512, 2049, 256)}
