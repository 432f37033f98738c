"""``--dtype auto`` on a vLLM worker resolves as it does for Sluice's own engine."""

from __future__ import annotations

import pytest

from workers.vllm_engine import resolve_dtype


@pytest.mark.parametrize(
    ("dtype", "cpu", "bf16_flag", "resolved"),
    [
        ("auto", True, None, "float32"),  # bfloat16 emulated: float32 is faster
        ("auto", True, "avx512_bf16", "auto"),  # native: vLLM's own auto, the checkpoint's
        ("auto", True, "amx_bf16", "auto"),
        ("auto", False, None, "auto"),  # a GPU
        ("bfloat16", True, None, "bfloat16"),  # named: what was asked
        ("float16", False, None, "float16"),
    ],
)
def test_auto_is_float32_on_a_cpu_without_native_bfloat16(
    dtype: str, cpu: bool, bf16_flag: str | None, resolved: str
) -> None:
    assert resolve_dtype(dtype, cpu, bf16_flag) == resolved
