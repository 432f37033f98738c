"""``vnni_gemm``: the VNNI kernels against the dequantized weights and PyTorch's kernels."""

from __future__ import annotations

import pytest
import torch

from engine import compiled
from engine.model import quantized, vnni_gemm
from engine.model.quantized import GROUP_SIZE, Int4Linear, Int8Linear

pytestmark = pytest.mark.skipif(
    not vnni_gemm.available(), reason="the VNNI kernels do not run here"
)


def _weight_and_input(
    out_features: int, in_features: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(out_features + rows)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.02
    weight[:, 7] *= 20  # a loud input channel, as trained models have
    x = torch.randn(rows, in_features, generator=generator)
    x[:, 7] *= 30  # and its activation: it sets its group's int8 scale
    return weight.bfloat16(), x.bfloat16()


def _layer_and_input(
    out_features: int, in_features: int, rows: int
) -> tuple[Int4Linear, torch.Tensor]:
    weight, x = _weight_and_input(out_features, in_features, rows)
    return Int4Linear(weight, None), x


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 64])
@pytest.mark.parametrize("shape", [(64, 32), (192, 96), (960, 576)])
def test_it_is_as_close_to_the_dequantized_weight_as_pytorchs_kernel(
    rows: int, shape: tuple[int, int]
) -> None:
    """Every tile of rows, and the tail, lands where x·Wᵀ does; the int8 activations and
    their remainders lose no more than PyTorch's bfloat16 arithmetic does."""
    layer, x = _layer_and_input(*shape, rows)
    exact = x.float() @ layer.dequantized_transposed().float()
    ours = torch.ops.sluice.int4_gemm(x, layer.weight, layer.scales_and_zeros)
    pytorchs = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, layer.weight, GROUP_SIZE, layer.scales_and_zeros
    ).float()
    assert ours.dtype == torch.float32 and ours.shape == exact.shape
    scale = exact.abs().max()
    assert (ours - exact).abs().max() <= max(2e-3 * scale, (pytorchs - exact).abs().max())


@pytest.mark.parametrize("rows", [1, 4, 5, 9, 64])
@pytest.mark.parametrize("shape", [(16, 64), (48, 128), (960, 576)])
def test_int8_is_as_close_to_its_weight_as_pytorchs_kernel(
    rows: int, shape: tuple[int, int]
) -> None:
    """16 outputs at a time transposed from rows of 64 inputs, the activations made unsigned
    and their offset taken back out: what remains is the activations' rounding."""
    weight, x = _weight_and_input(*shape, rows)
    layer = Int8Linear(weight, None)
    dequantized = layer.dequantized().float()
    exact = x.float() @ dequantized.T
    ours = torch.ops.sluice.int8_gemm(x, layer.weight, layer.scale)
    pytorchs = torch.ops.aten._weight_int8pack_mm(x, layer.weight, layer.scale).float()
    assert ours.dtype == torch.float32 and ours.shape == exact.shape
    scale = exact.abs().max()
    assert (ours - exact).abs().max() <= max(2e-3 * scale, (pytorchs - exact).abs().max())


def test_a_group_of_zeros_and_a_row_of_zeros_give_exact_zeros() -> None:
    """An all-zero group has scale 0: it must contribute nothing, not NaN."""
    layer, x = _layer_and_input(128, 64, 3)
    x[0] = 0
    x[1, :32] = 0
    ours = torch.ops.sluice.int4_gemm(x, layer.weight, layer.scales_and_zeros)
    assert torch.isfinite(ours).all()
    assert (ours[0] == 0).all()
    exact = x[1:2, 32:].float() @ layer.dequantized_transposed()[32:].float()
    torch.testing.assert_close(ours[1:2], exact, atol=2e-3 * exact.abs().max(), rtol=0)


def test_bad_shapes_and_dtypes_are_refused() -> None:
    layer, x = _layer_and_input(64, 64, 2)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.sluice.int4_gemm(x.float(), layer.weight, layer.scales_and_zeros)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.sluice.int4_gemm(x[:, :48], layer.weight, layer.scales_and_zeros)
    int8 = Int8Linear(torch.randn(64, 96, dtype=torch.bfloat16), None)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        torch.ops.sluice.int8_gemm(
            torch.randn(2, 96, dtype=torch.bfloat16), int8.weight, int8.scale
        )


def test_the_int8_kernel_starts_where_the_many_rows_graph_does() -> None:
    """A graph exported for 4-64 rows must not branch on its row count inside the range."""
    assert quantized.INT8_VNNI_FROM_ROWS == compiled.MANY_ROWS
