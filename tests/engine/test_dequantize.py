"""``int4_dequantize``: the kernel against PyTorch's ops on the same pack, bit for bit."""

from __future__ import annotations

import pytest
import torch

from engine.model import dequantize
from engine.model.quantized import Int4Linear

pytestmark = pytest.mark.skipif(
    not dequantize.available(), reason="the int4 dequantize kernel does not run here"
)


def _layer(rows: int, columns: int, dtype: torch.dtype, seed: int = 0) -> Int4Linear:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=generator) * 0.05
    weight[:64, :32] *= 1e3  # groups of very different ranges
    return Int4Linear(weight.to(dtype), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "columns"), [(64, 32), (192, 96), (960, 576), (576, 1536)])
def test_the_kernel_gives_what_pytorchs_ops_give(
    rows: int, columns: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer = _layer(rows, columns, dtype, seed=rows + columns)
    assert layer.layout.block == dequantize.PACK_BLOCK and layer.layout.in_order
    assert dequantize.serves(layer.layout.block, layer.layout.in_order, dtype)
    ours = layer.dequantized_transposed()
    monkeypatch.setattr(dequantize, "serves", lambda *_: False)  # PyTorch's ops
    theirs = layer.dequantized_transposed()
    assert ours.dtype == theirs.dtype == dtype
    assert ours.shape == theirs.shape == (columns, rows)
    assert torch.equal(ours, theirs)


def test_what_the_kernel_refuses() -> None:
    layer = _layer(128, 64, torch.bfloat16)
    pack, scales = layer.weight, layer.scales_and_zeros
    for args in [
        (pack.float(), scales, torch.bfloat16),  # not a uint8 pack
        (pack[:64], scales, torch.bfloat16),  # scales of other rows
        (pack, scales.float(), torch.bfloat16),
        (pack, scales, torch.float16),
        (pack[:, 1:].contiguous(), scales, torch.bfloat16),  # inputs not in 32s
    ]:
        with pytest.raises(RuntimeError):
            dequantize.int4_transposed(*args)
    assert not dequantize.serves(32, True, torch.bfloat16)  # AVX2's pack
    assert not dequantize.serves(64, False, torch.bfloat16)
    assert not dequantize.serves(64, True, torch.float16)
