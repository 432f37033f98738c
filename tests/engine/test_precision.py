"""The default precision: bfloat16 where the CPU computes it natively, quantized weights kept.

The model test bounds how far the default configuration's logprobs move from
the float32 model's on a fixed prompt set.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.quantized import QuantizedEmbedding
from engine.precision import resolve_precision, stored_methods
from shared.cpu import native_bf16_flag

CPU, CUDA = torch.device("cpu"), torch.device("cuda")

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):",
    "The three primary colors are",
    "<|im_start|>user\nName a large animal.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
]
LOGPROB_BOUNDS = {torch.bfloat16: 0.5, torch.float32: 0.5}
"""Largest per-token logprob difference from float32 on PROMPTS' continuations, by the dtype
the default computes in (measured: 0.24-0.26 in bfloat16, 0.30 in float32, where every
low-bit layer still takes its input in bfloat16)."""


@pytest.mark.parametrize(
    ("dtype", "quantization", "device", "flag", "expected"),
    [
        ("auto", "auto", CPU, "avx512_bf16", (torch.bfloat16, "stored")),
        ("auto", "auto", CPU, "amx_bf16", (torch.bfloat16, "stored")),
        ("auto", "auto", CPU, None, (torch.float32, "none")),  # as --dtype float32
        ("auto", "auto", CUDA, None, (torch.bfloat16, "none")),
        ("auto", "none", CPU, "avx512_bf16", (torch.bfloat16, "none")),
        ("bfloat16", "auto", CPU, None, (torch.bfloat16, "stored")),
        ("float32", "auto", CPU, "avx512_bf16", (torch.float32, "none")),
        ("float16", "auto", CUDA, None, (torch.float16, "none")),
        ("auto", "int4", CPU, None, (torch.float32, "int4")),
        ("auto", "int4", CPU, "amx_bf16", (torch.bfloat16, "int4")),
        ("bfloat16", "int8", CPU, "avx512_bf16", (torch.bfloat16, "int8")),
        ("float32", "int8", CPU, "avx512_bf16", (torch.float32, "int8")),
        ("auto", "int8", CPU, None, (torch.float32, "int8")),
        ("auto", "stored", CPU, None, (torch.float32, "stored")),  # fast, not invariant
        ("float32", "stored", CPU, "avx512_bf16", (torch.float32, "stored")),
    ],
)
def test_precision_follows_the_hardware(dtype, quantization, device, flag, expected) -> None:
    precision = resolve_precision(dtype, quantization, device, flag)
    assert (precision.dtype, precision.quantization) == expected
    explicit = quantization in ("int8", "int4", "stored")
    assert precision.reason.startswith("quantization" if explicit else f"dtype {dtype}")


@pytest.mark.parametrize(
    ("dtype", "quantization", "device", "own_kernels", "expected"),
    [
        ("auto", "auto", CPU, True, (torch.bfloat16, True)),
        ("auto", "auto", CPU, False, (torch.float32, False)),  # bfloat16 would follow the batch
        ("bfloat16", "auto", CPU, True, (torch.bfloat16, True)),
        ("bfloat16", "auto", CPU, False, (torch.bfloat16, False)),  # asked for by name
        ("float32", "auto", CPU, True, (torch.float32, False)),
        ("auto", "auto", CUDA, False, (torch.bfloat16, False)),
    ],
)
def test_the_default_is_batch_invariant_where_the_engines_kernels_run(
    dtype: str,
    quantization: str,
    device: torch.device,
    own_kernels: bool,
    expected: tuple[torch.dtype, bool],
) -> None:
    precision = resolve_precision(dtype, quantization, device, "avx512_bf16", own_kernels)
    assert (precision.dtype, precision.batch_invariant) == expected
    if dtype == "auto" and device == CPU and not own_kernels:
        assert "batch-invariant kernels do not run here" in precision.reason


@pytest.mark.parametrize(
    ("dtype", "quantization", "flag", "kv_dtype"),
    [
        ("auto", "auto", None, torch.float32),  # dense without native bfloat16
        ("auto", "int8", None, torch.bfloat16),
        ("auto", "auto", "avx512_bf16", torch.bfloat16),
        ("float32", "auto", None, torch.float32),  # dense: transformers' parity
        ("auto", "none", None, torch.float32),
    ],
)
def test_a_model_with_low_bit_layers_keeps_its_kv_cache_in_bfloat16(
    dtype: str, quantization: str, flag: str | None, kv_dtype: torch.dtype
) -> None:
    assert resolve_precision(dtype, quantization, CPU, flag).kv_dtype == kv_dtype


@pytest.mark.parametrize(
    ("dtype", "quantization", "device", "message"),
    [
        ("float16", "int8", CPU, "computes in bfloat16 or float32, not float16"),
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


def _teacher_forced_logprobs(llm: LLM, token_ids: list[list[int]]) -> list[list[float]]:
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    return [
        [entry.logprob for entry in out.prompt_logprobs] for out in llm.generate(token_ids, params)
    ]


def test_the_default_precision_stays_near_float32() -> None:
    """The default (bfloat16 with the GGUF's Q4_1 layers as int4 and its Q8_0 head as int8,
    where the engine's kernels run) against dense float32; elsewhere the default is dense
    float32 itself.

    Both models score the float32 model's own greedy continuations (teacher
    forcing), so one early difference cannot snowball; the first greedy token
    must agree for all prompts but one.
    """
    fast = LLM(dtype="auto", max_model_len=256, num_kv_blocks=64)
    reference = LLM(dtype="float32", max_model_len=256, num_kv_blocks=64)
    dtype = fast.engine.precision.dtype
    prompts = [reference.encode(prompt) for prompt in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    if not fast.engine.precision.batch_invariant:
        assert (dtype, fast.engine.precision.quantization) == (torch.float32, "none")
        assert "float32 with dense weights" in fast.engine.description
        same = zip(fast.generate(prompts, greedy), reference.generate(prompts, greedy), strict=True)
        assert all(ours.token_ids == theirs.token_ids for ours, theirs in same)
        return
    assert dtype == torch.bfloat16
    assert "weights int4 x120, int8 x1 on the VNNI kernels" in fast.engine.description
    model = fast.engine.runner.model
    assert isinstance(model.embed_tokens, QuantizedEmbedding)  # no dense copy of the tied head
    assert fast.engine.runner.attention.kv_cache.k.dtype == torch.bfloat16

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
    assert max(differences) < LOGPROB_BOUNDS[dtype], max(differences)
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


def test_a_quantized_model_never_holds_its_dense_weights_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Loading quantizes each layer as soon as its tensors are in: the linear layers that hold
    dense weights at once stay a small part of the model (the largest, the tied head, is 21%)."""
    from engine.config import EngineArgs
    from engine.model.layers import Linear
    from engine.model.llama import LlamaForCausalLM
    from engine.setup import load_engine_model, tensor_layers

    largest = 0  # weights held dense at once, in linear layers that got their tensors
    load_weights = LlamaForCausalLM.load_weights

    def watched(model: LlamaForCausalLM, tensors):  # noqa: ANN001, ANN202
        filled: set[str] = set()

        def dense() -> int:
            layers = (model.get_submodule(layer) for layer in filled)
            return sum(layer.weight.numel() for layer in layers if isinstance(layer, Linear))

        def counted():  # noqa: ANN202
            nonlocal largest
            for hf_name, tensor in tensors:
                largest = max(largest, dense())
                filled.update(tensor_layers(model, hf_name))
                yield hf_name, tensor
            largest = max(largest, dense())

        load_weights(model, counted())

    monkeypatch.setattr(LlamaForCausalLM, "load_weights", watched)
    loaded = load_engine_model(EngineArgs(dtype="bfloat16", max_model_len=64, num_kv_blocks=1))
    model = loaded.model
    assert len(loaded.quantized) == 121
    cfg = model.cfg
    per_layer = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * cfg.hidden_size + (
        cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.intermediate_size * cfg.hidden_size
    )
    total = cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size
    assert largest < 0.25 * total, (largest, total)
