"""Weight-only int8 and int4: the layers against dense arithmetic, the int8 model against fp32."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.model import dequantize, quantized, vnni_gemm
from engine.model.layers import Linear
from engine.model.quantized import Int4Linear, Int8Linear, QuantizedEmbedding, quantize_linears
from engine.setup import LoadedModel
from shared.cpu import cpu_flags

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):",
    "The three primary colors are",
    "<|im_start|>user\nName a large animal.<|im_end|>\n<|im_start|>assistant\n",
]


def _random_linear(
    out_features: int, in_features: int, bias: bool, dtype: torch.dtype = torch.float32
) -> Linear:
    torch.manual_seed(0)
    layer = Linear(in_features, out_features, bias)
    layer.weight.data.normal_(0, 0.05)
    # One loud group of 32 inputs, as trained models have: its scale must leak neither
    # into other rows (int8 scales rows) nor into the row's other groups (int4 scales groups).
    layer.weight.data[3, :32] *= 40
    if bias:
        layer.bias.data.normal_(0, 0.5)
    return layer.to(dtype)


ROWS = [
    1,
    5,
    quantized.AMX_INT4_DENSE_FROM_ROWS,
    quantized.DENSE_FROM_ROWS,
    150,
    400,
]
"""The thresholds between the low-bit kernels and the dense GEMM, and rows below and above."""

DTYPES = [torch.bfloat16, torch.float32]
"""What a model with low-bit layers computes in: each layer takes and returns its model's dtype."""


@pytest.fixture(params=["vnni", "aten"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The low-bit kernels a layer runs: ``vnni_gemm``'s (where they run here) or PyTorch's."""
    if request.param == "aten":
        monkeypatch.setattr(quantized.vnni_gemm, "available", lambda: False)
    elif not vnni_gemm.available():
        pytest.skip("the VNNI kernels do not run here")
    quantized._int4_dense_from_rows.cache_clear()  # the threshold follows the kernel
    yield request.param
    quantized._int4_dense_from_rows.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", ROWS)
def test_int8_linear_matches_dense_arithmetic(
    rows: int, bias: bool, dtype: torch.dtype, kernel: str
) -> None:
    """Each int8 kernel (``vnni_gemm``'s where it runs, else PyTorch's) and the dequantized
    GEMM (many rows) compute x·Wᵀ+b."""
    dense = _random_linear(96, 64, bias, dtype)
    layer = quantized.quantize(dense, "int8")
    assert layer.codes().dtype == torch.int8 and layer.codes().shape == (96, 64)
    assert layer.scale.shape == (96,)

    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(dtype)
    y = layer(x)
    assert y.dtype == dtype
    got = y.float()
    exact = F.linear(
        x.float(), dense.weight.float(), None if dense.bias is None else dense.bias.float()
    )
    dequantized = layer.codes().float() * layer.scale.float()[:, None]
    expected = F.linear(x.float(), dequantized, None if layer.bias is None else layer.bias.float())

    torch.testing.assert_close(got, expected, atol=0.05, rtol=0.02)
    # Per-row scales: the loud row does not coarsen the quiet ones.
    quiet = torch.ones(96, dtype=torch.bool)
    quiet[3] = False
    error = (got - exact)[:, quiet].abs().max()
    assert error < 0.05 * exact[:, quiet].abs().max(), error


def test_quantize_linears_replaces_every_projection(loaded_float32_model: LoadedModel) -> None:
    """Every Linear (tied lm_head included) becomes int8; the embedding reads the head's rows."""
    model = loaded_float32_model.model
    cfg = model.cfg
    small = type(model)(cfg, 64)
    small.load_state_dict(model.state_dict())
    embedding = small.embed_tokens.weight.clone()

    chosen = quantize_linears(small, "int8")

    assert not [name for name, m in small.named_modules() if isinstance(m, Linear)]
    int8 = [m for m in small.modules() if isinstance(m, Int8Linear)]
    assert len(int8) == len(chosen) == 4 * cfg.num_layers + 1
    assert isinstance(small.embed_tokens, QuantizedEmbedding)
    ids = torch.tensor([0, 7, cfg.vocab_size - 1])
    rows = small.embed_tokens(ids).float()
    torch.testing.assert_close(
        rows, embedding[ids], atol=embedding.abs().max().item() / 127, rtol=0
    )


def test_quantized_default_model_follows_fp32(loaded_model: LoadedModel) -> None:
    """The int8 model's first choice is fp32's, or within a hair of it, for every prompt."""
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=20)
    encode = loaded_model.tokenizer.tokenizer.encode
    prompts = [encode(p).ids for p in PROMPTS]
    int8 = LLM(quantization="int8", dtype="bfloat16", max_model_len=256, num_kv_blocks=64)
    assert int8.engine.precision.dtype == torch.bfloat16
    fp32 = LLM(dtype="float32", max_model_len=256, num_kv_blocks=64)

    ours, reference = int8.generate(prompts, params), fp32.generate(prompts, params)

    assert "Paris" in ours[0].text, ours[0].text
    same_first = 0
    for got, want in zip(ours, reference, strict=True):
        first = got.logprobs[0]
        alternatives = dict(first.top)
        wanted = want.token_ids[0]
        assert wanted in alternatives, (want.text, got.text)
        assert first.logprob - alternatives[wanted] < 0.5, (want.text, got.text)
        same_first += got.token_ids[0] == wanted
    assert same_first >= len(PROMPTS) - 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", ROWS)
def test_int4_linear_matches_its_dequantized_weight(
    rows: int, bias: bool, dtype: torch.dtype, kernel: str
) -> None:
    """Each int4 kernel (``vnni_gemm``'s where it runs, else PyTorch's) and the dequantized
    GEMM (many rows) compute x·Wᵀ+b."""
    dense = _random_linear(192, 96, bias, dtype)
    layer = quantized.quantize(dense, "int4")
    assert isinstance(layer, Int4Linear) and layer.weight.dtype == torch.uint8

    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
    weight = layer.dequantized_transposed().float().T
    expected = F.linear(x.float(), weight, None if layer.bias is None else layer.bias.float())
    y = layer(x)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), expected, atol=0.05, rtol=0.02)
    # Each group of 32 has its own scale: quiet weights stay within half a quiet step.
    quiet = weight - dense.weight.float()
    quiet[3, :32] = 0
    assert quiet.abs().max() < 0.6 * (0.05 * 8 / 15), quiet.abs().max()


def _ops_run(layer: Int4Linear, rows: int) -> set[str]:
    x = torch.randn(rows, layer.in_features).to(layer.dtype)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        layer(x)
    return {event.key for event in profile.key_averages()}


@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_layers_dequantize_from_the_rows_this_cpu_measures(
    dtype: torch.dtype, kernel: str
) -> None:
    """On the VNNI kernel an int4 layer runs it at every number of rows, so a row's output
    does not depend on its batch. On PyTorch's kernel it runs below ``dense_from_rows()``
    and from there dequantizes and runs the GEMM: with the dequantize kernel in bfloat16 on
    AMX, from the rows measured there."""
    layer = quantized.quantize(_random_linear(192, 96, False, dtype), "int4")
    if kernel == "vnni":
        for rows in (1, 64, 400):
            ran = _ops_run(layer, rows)
            assert "sluice::int4_gemm" in ran and "aten::mm" not in ran
        return
    amx = torch.cpu._is_amx_tile_supported()
    by_kernel = dequantize.available() and dtype == torch.bfloat16
    expected = (
        quantized.AMX_INT4_DENSE_FROM_ROWS if amx and by_kernel else quantized.DENSE_FROM_ROWS
    )
    assert layer.dense_from_rows() == expected

    low_bit = "aten::_weight_int4pack_mm_for_cpu"
    below, above = _ops_run(layer, expected - 1), _ops_run(layer, expected)
    assert low_bit in below and "aten::mm" not in below
    assert low_bit not in above and "aten::mm" in above
    if dequantize.serves(layer.layout.block, layer.layout.in_order, dtype):
        assert "sluice::int4_dequantize" in above


def test_int4_keeps_the_codes_of_a_q4_1_grid() -> None:
    """A weight on a Q4_1 grid (w = q·s + m, bfloat16 s and m) keeps every code q.

    The kernel's zero point m + 8s, the product (q - 8)·s and their sum are each
    rounded to bfloat16 once; a code is never lost.
    """
    generator = torch.Generator().manual_seed(3)
    rows, columns = 128, 64
    codes = torch.randint(0, 16, (rows, columns), generator=generator)
    codes[:, ::32] = 0  # every group spans the whole range, as Q4_1's min and max do
    codes[:, 1::32] = 15
    scale = (torch.rand(rows, columns // 32, generator=generator) / 10).bfloat16().float()
    # As in trained weights, a group's minimum is near minus half its range.
    offset = 5 + 5 * torch.rand(rows, columns // 32, generator=generator)
    low = (-offset * scale).bfloat16().float()
    scale, low = scale.repeat_interleave(32, 1), low.repeat_interleave(32, 1)
    weight = codes * scale + low

    layer = Int4Linear(weight, None)

    dequantized = layer.dequantized_transposed().float().T
    assert torch.equal(((dequantized - low) / scale).round(), codes.float())
    terms = (low + 8 * scale).abs() + ((codes - 8) * scale).abs() + weight.abs()
    rounding = 2**-8 * terms  # each term is rounded once to bfloat16
    assert ((dequantized - weight).abs() <= rounding).all()
    ids = torch.tensor([0, 5, 31, 32, 63, 64, 100, 127])
    assert torch.equal(layer.rows(ids), layer.dequantized_transposed().T[ids])


def test_int4_falls_back_to_int8_where_the_pack_cannot_hold_the_shape() -> None:
    assert isinstance(quantized.quantize(_random_linear(8, 96, False), "int4"), Int8Linear)


PACK_CHECK = """
import torch
from engine.model.quantized import Int4Linear, pack_layout
torch.manual_seed(0)
layer = Int4Linear(torch.randn(192, 96) * 0.05, None)
x = torch.randn(3, 96)
expected = x @ layer.dequantized_transposed()
torch.testing.assert_close(layer(x), expected, atol=0.02, rtol=0.02)
ids = torch.tensor([0, 5, 16, 31, 32, 63, 64, 100, 191])
assert torch.equal(layer.rows(ids), layer.dequantized_transposed().T[ids])
print(torch.backends.cpu.get_cpu_capability(), pack_layout().block)
"""


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_int4_reads_the_pack_layout_of_every_cpu_capability(capability: str) -> None:
    """PyTorch packs int4 rows by the vector width it dispatches to; dequantizing and
    embedding lookups read the pack the kernel reads, whichever that is."""
    needed = {"avx2": "avx2", "avx512": "avx512f"}.get(capability)
    if needed is not None and needed not in cpu_flags():
        pytest.skip(f"this CPU has no {capability}")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run(
        [sys.executable, "-c", PACK_CHECK], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    expected_block = 64 if capability == "avx512" else 32
    assert done.stdout.split() == [capability.upper(), str(expected_block)]
