"""The engine on a CUDA device, and the KV cache's share of it (``--gpu-memory-utilization``).

Tests that need a CUDA device skip without one; the refusals run everywhere.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.test_registry_models import make_tiny_model

GiB = 2**30
PROMPTS = ["hello there", "the sea at night is", "one two three four five six"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "model"
    return str(make_tiny_model(path, hidden_size=64, intermediate_size=128))


@pytest.fixture
def released() -> Iterator[None]:
    """Each CUDA test starts with the device as the one before it found it."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def in_use() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_a_cpu_engine_refuses_a_gpu_fraction(tiny: str) -> None:
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(tiny, device="cpu", gpu_memory_utilization=0.5)


@pytest.mark.parametrize("size", [{"kv_cache_bytes": 2**24}, {"num_kv_blocks": 64}])
def test_a_gpu_fraction_beside_a_cache_size_is_refused(tiny: str, size: dict) -> None:
    with pytest.raises(ValueError, match="give one"):
        LLM(tiny, gpu_memory_utilization=0.5, **size)


@pytest.mark.parametrize("fraction", [0.0, 1.5])
def test_a_fraction_outside_0_to_1_is_refused(tiny: str, fraction: float) -> None:
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        LLM(tiny, gpu_memory_utilization=fraction)


@needs_cuda
def test_float32_on_cuda_decodes_what_the_cpu_decodes(tiny: str, released: None) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    on_gpu = LLM(tiny, device="cuda", dtype="float32", max_num_seqs=4)
    assert "cuda" in on_gpu.engine.description
    ours = on_gpu.generate(PROMPTS, params)
    theirs = LLM(tiny, device="cpu", dtype="float32", max_num_seqs=4).generate(PROMPTS, params)
    for a, b in zip(ours, theirs, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-3)


@needs_cuda
def test_auto_computes_in_bfloat16_on_cuda(tiny: str, released: None) -> None:
    llm = LLM(tiny, device="cuda", dtype="auto", max_num_seqs=4)
    assert llm.engine.runner.model.embed_tokens.weight.dtype == torch.bfloat16
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert all(len(out.token_ids) == 8 for out in llm.generate(PROMPTS, params))


@needs_cuda
def test_the_kv_cache_fills_the_device_to_the_fraction(tiny: str, released: None) -> None:
    """Two GiB above what is in use now: the cache takes what the weights and a step leave."""
    total = torch.cuda.mem_get_info()[1]
    fraction = (in_use() + 2 * GiB) / total
    llm = LLM(tiny, device="cuda", dtype="float32", gpu_memory_utilization=fraction)
    cache = llm.engine.runner.attention.kv_cache
    cache_bytes = cache.k.nbytes + cache.v.nbytes
    assert 1.5 * GiB < cache_bytes < 2 * GiB
    assert fraction * total - 0.5 * GiB < in_use() <= fraction * total
    # A step at the batch's limits still fits in the fraction: 32 sequences at once.
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    torch.cuda.reset_peak_memory_stats()
    outputs = llm.generate(["tell me about the sea " * 20] * 32, params)
    assert all(len(out.token_ids) == 32 for out in outputs)
    assert torch.cuda.max_memory_reserved() <= fraction * total


@needs_cuda
def test_a_fraction_below_what_is_in_use_is_refused(tiny: str, released: None) -> None:
    total = torch.cuda.mem_get_info()[1]
    fraction = max(in_use() - GiB, GiB // 4) / total
    with pytest.raises(ValueError, match="no room is left for the KV cache"):
        LLM(tiny, device="cuda", dtype="float32", gpu_memory_utilization=fraction)
