"""The default precision: bfloat16 where the CPU computes it natively, quantized weights kept.

The layer tests check int4 arithmetic against the dense dequantized weight;
the model test bounds how far the default configuration's logprobs move from
the float32 model's on a fixed prompt set.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.model import quantized
from engine.model.layers import Linear
from engine.model.quantized import Int4Linear, Int8Linear, QuantizedEmbedding
from engine.precision import native_bf16_flag, resolve_precision, stored_methods

CPU, CUDA = torch.device("cpu"), torch.device("cuda")

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):",
    "The three primary colors are",
    "<|im_start|>user\nName a large animal.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
]
LOGPROB_BOUND = 0.5
"""Largest per-token logprob difference from float32 on PROMPTS' continuations (0.26 measured)."""


@pytest.mark.parametrize(
    ("dtype", "quantization", "device", "flag", "expected"),
    [
        ("auto", "auto", CPU, "avx512_bf16", (torch.bfloat16, "stored")),
        ("auto", "auto", CPU, "amx_bf16", (torch.bfloat16, "stored")),
        ("auto", "auto", CPU, None, (torch.float32, "none")),
        ("auto", "auto", CUDA, None, (torch.bfloat16, "none")),
        ("auto", "none", CPU, "avx512_bf16", (torch.bfloat16, "none")),
        ("bfloat16", "auto", CPU, None, (torch.bfloat16, "stored")),
        ("float32", "auto", CPU, "avx512_bf16", (torch.float32, "none")),
        ("float16", "auto", CUDA, None, (torch.float16, "none")),
        ("auto", "int4", CPU, None, (torch.bfloat16, "int4")),
        ("bfloat16", "int8", CPU, "avx512_bf16", (torch.bfloat16, "int8")),
    ],
)
def test_precision_follows_the_hardware(dtype, quantization, device, flag, expected) -> None:
    precision = resolve_precision(dtype, quantization, device, flag)
    assert (precision.dtype, precision.quantization) == expected
    explicit = quantization in ("int8", "int4")
    assert precision.reason.startswith("quantization" if explicit else f"dtype {dtype}")


@pytest.mark.parametrize(
    ("dtype", "quantization", "device", "message"),
    [
        ("float32", "int8", CPU, "computes in bfloat16"),
        ("auto", "int8", CUDA, "runs on CPU only"),
        ("auto", "int3", CPU, "'int3' is not supported; use one of int8, int4"),
        ("double", "auto", CPU, "dtype 'double' is not supported"),
    ],
)
def test_bad_precision_is_refused_before_loading(dtype, quantization, device, message) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_precision(dtype, quantization, device, "avx512_bf16")


def test_native_bfloat16_is_read_from_the_cpu_flags(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 avx512_vnni\n")
    assert native_bf16_flag(cpuinfo) == "avx512_bf16"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 fma\n")
    assert native_bf16_flag(cpuinfo) is None
    assert native_bf16_flag(tmp_path / "absent") is None


def test_stored_widths_choose_each_layers_method() -> None:
    """All 4-bit → int4; up to 8.5 bits → int8; any float tensor keeps the layer dense."""
    methods = stored_methods(
        {"a": [4.5, 5.0], "b": [4.5, 8.5], "c": [6.5625], "d": [5.0, None], "e": [16.5], "f": []}
    )
    assert methods == {"a": "int4", "b": "int8", "c": "int8"}


def _linear(out_features: int, in_features: int, bias: bool) -> Linear:
    torch.manual_seed(0)
    layer = Linear(in_features, out_features, bias)
    layer.weight.data.normal_(0, 0.05)
    layer.weight.data[3, :32] *= 40  # a loud group must not coarsen its neighbours
    if bias:
        layer.bias.data.normal_(0, 0.5)
    return layer


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, quantized.DENSE_FROM_ROWS, 150])
def test_int4_linear_matches_its_dequantized_weight(rows: int, bias: bool) -> None:
    """The int4 kernel (few rows) and the dequantized GEMM (many) both compute x·Wᵀ+b."""
    dense = _linear(192, 96, bias)
    layer = quantized.quantize(dense, "int4")
    assert isinstance(layer, Int4Linear) and layer.weight.dtype == torch.uint8

    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
    weight = layer.dequantized_transposed().float().T
    expected = F.linear(x.float(), weight, None if layer.bias is None else layer.bias.float())
    torch.testing.assert_close(layer(x).float(), expected, atol=0.05, rtol=0.02)
    # Each group of 32 has its own scale: quiet weights stay within half a quiet step.
    quiet = weight - dense.weight
    quiet[3, :32] = 0
    assert quiet.abs().max() < 0.6 * (0.05 * 8 / 15), quiet.abs().max()


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
    assert isinstance(quantized.quantize(_linear(8, 96, False), "int4"), Int8Linear)


def _teacher_forced_logprobs(llm: LLM, token_ids: list[list[int]]) -> list[list[float]]:
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    return [
        [entry.logprob for entry in out.prompt_logprobs] for out in llm.generate(token_ids, params)
    ]


def test_the_default_precision_stays_near_float32() -> None:
    """bfloat16 with the GGUF's Q4_1 layers as int4 and its Q8_0 head as int8, against float32.

    Both models score the float32 model's own greedy continuations (teacher
    forcing), so one early difference cannot snowball; the first greedy token
    must agree for all prompts but one.
    """
    fast = LLM(dtype="bfloat16", max_model_len=256, num_kv_blocks=64)
    reference = LLM(dtype="float32", max_model_len=256, num_kv_blocks=64)
    assert "weights int4 x120, int8 x1" in fast.engine.description
    model = fast.engine.runner.model
    assert isinstance(model.embed_tokens, QuantizedEmbedding)  # no dense copy of the tied head
    prompts = [reference.encode(prompt) for prompt in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=24)

    wanted = reference.generate(prompts, greedy)
    got = fast.generate(prompts, greedy)
    scored = [prompt + out.token_ids for prompt, out in zip(prompts, wanted, strict=True)]
    differences = [
        abs(a - b)
        for ours, theirs in zip(
            _teacher_forced_logprobs(fast, scored),
            _teacher_forced_logprobs(reference, scored),
            strict=True,
        )
        for a, b in zip(ours, theirs, strict=True)
    ]

    assert "Paris" in got[0].text, got[0].text
    same_first = sum(g.token_ids[0] == w.token_ids[0] for g, w in zip(got, wanted, strict=True))
    assert same_first >= len(PROMPTS) - 1
    assert max(differences) < LOGPROB_BOUND, max(differences)
    print(f"max |Δ logprob| {max(differences):.3f}, mean {sum(differences) / len(differences):.4f}")


def test_loading_leaves_the_thread_count_as_it_was() -> None:
    """The model loads on one thread (no OpenMP team beside the stepping thread's), then
    the process's thread count is back for the steps."""
    from engine.config import EngineArgs
    from engine.setup import load_engine_model

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        load_engine_model(EngineArgs(max_model_len=64, num_kv_blocks=1))
        assert torch.get_num_threads() == 2
        with pytest.raises(ValueError, match="not supported"):
            load_engine_model(EngineArgs(dtype="double"))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
