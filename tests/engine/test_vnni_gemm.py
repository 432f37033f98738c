"""``vnni_gemm``: the VNNI kernels against the dequantized weights and PyTorch's kernels."""

from __future__ import annotations

import pytest
import torch

from engine.model import vnni_gemm
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
    ours = torch.ops.sluice.int8_gemm(x, layer.pack, layer.sums, layer.scale)
    pytorchs = torch.ops.aten._weight_int8pack_mm(x, layer.codes(), layer.scale).float()
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
    int8 = Int8Linear(torch.randn(64, 128, dtype=torch.bfloat16), None)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        torch.ops.sluice.int8_pack(torch.zeros(64, 96, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="pack"):
        torch.ops.sluice.int8_gemm(
            torch.randn(2, 64, dtype=torch.bfloat16), int8.pack, int8.sums, int8.scale
        )


def _rows_alone(layer: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.cat(
        [torch.ops.sluice.int4_gemm(row[None], layer.weight, layer.scales_and_zeros) for row in x]
    )


@pytest.mark.parametrize(
    "shape", [(960, 576), (3072, 576), (576, 1536), (64, 32), (320, 96), (448, 160)]
)
def test_each_row_gets_the_same_bits_whatever_rows_come_with_it(shape: tuple[int, int]) -> None:
    """Batch invariance: a row's outputs do not depend on how many rows the call has (the
    few-rows and the many-rows tiles, every tile size, every tail) nor on what they hold."""
    layer, x = _layer_and_input(*shape, 1000)
    alone = _rows_alone(layer, x)
    for rows in (2, 3, 5, 8, 17, 31, 32, 33, 64, 65, 300, 1000):
        together = torch.ops.sluice.int4_gemm(x[:rows], layer.weight, layer.scales_and_zeros)
        assert torch.equal(together, alone[:rows]), rows
    # the same rows behind other rows, at other positions in their tiles
    for offset in (1, 2, 3, 37):
        together = torch.ops.sluice.int4_gemm(
            x[offset : offset + 300], layer.weight, layer.scales_and_zeros
        )
        assert torch.equal(together, alone[offset : offset + 300]), offset
    # and among rows of other magnitudes
    others = x[:65].flip(0) * 1000
    for position in (0, 1, 30, 31, 32, 64):
        mixed = others.clone()
        mixed[position] = x[position]
        together = torch.ops.sluice.int4_gemm(mixed, layer.weight, layer.scales_and_zeros)
        assert torch.equal(together[position], alone[position]), position


def test_rows_the_many_rows_tiles_cannot_hold_get_the_same_bits() -> None:
    """An infinite or NaN input, or a group of subnormal ones, quantizes to codes of -128,
    which 256 c + f cannot hold in int16: such a row takes the few-rows path, as when alone."""
    layer, x = _layer_and_input(192, 96, 40)
    x[3, 5] = float("inf")
    x[7, 40] = float("nan")
    x[11, 64:96] = 1e-39
    x[11, 70] = -3e-39
    x[20, :32] = -float("inf")
    alone = _rows_alone(layer, x)
    together = torch.ops.sluice.int4_gemm(x, layer.weight, layer.scales_and_zeros)
    assert torch.equal(together.isnan(), alone.isnan())
    assert torch.equal(together.nan_to_num(), alone.nan_to_num())
    assert torch.isfinite(together[11]).all()


@pytest.mark.parametrize("shape", [(49152, 576), (960, 576), (48, 128), (80, 64)])
def test_int8_rows_get_the_same_bits_whatever_rows_come_with_them(
    shape: tuple[int, int],
) -> None:
    """One row takes 64 outputs a tile and more rows take 16 (the tail 16 at a time), and where
    AMX runs, 32 rows or more take its tiles (16 rows, the last padded); a row's outputs are
    the same bits every way, and the pack holds the layer's codes."""
    weight, x = _weight_and_input(*shape, 70)
    layer = Int8Linear(weight, None)
    alone = torch.cat(
        [torch.ops.sluice.int8_gemm(row[None], layer.pack, layer.sums, layer.scale) for row in x]
    )
    for rows in (2, 3, 7, 8, 9, 31, 32, 33, 64, 70):
        together = torch.ops.sluice.int8_gemm(x[:rows], layer.pack, layer.sums, layer.scale)
        assert torch.equal(together, alone[:rows]), rows
    codes = layer.codes()
    scale = (weight.float().abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    assert torch.equal(codes, (weight.float() / scale[:, None]).round().to(torch.int8))
    ids = torch.tensor([[0, 17], [shape[0] - 1, 5]])
    assert torch.equal(layer.codes(ids), codes[ids])
