"""The low-bit linear kernels on the default model's shapes, beside PyTorch's.

    python -m bench.lowbit [--rows 1,4,32] [--repeats 50]   (or: sluice bench lowbit)

For each projection of SmolLM2-135M (the fused q/k/v, the output, the fused
gate and up, the down projection: int4 in the default GGUF; the tied head:
int8) and each row count, one process times:

- PyTorch's weight-only kernel (``_weight_int4pack_mm_for_cpu`` or
  ``_weight_int8pack_mm``), the baseline;
- ``vnni_gemm``'s kernel on the same weights, where it runs on this CPU;
- a bfloat16 GEMM on a dense copy, the memory-hungry alternative;
- for int4, dequantizing the pack then that GEMM, what prefill chunks from
  ``Int4Linear.dense_from_rows()`` rows run.

Each figure is the mean of ``--repeats`` calls after a warm-up, in ms.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from engine.model import vnni_gemm
from engine.model.quantized import GROUP_SIZE, Int4Linear, Int8Linear

SHAPES = {  # name: (out, in, bits)
    "qkv 960x576": (960, 576, 4),
    "o 576x576": (576, 576, 4),
    "gate_up 3072x576": (3072, 576, 4),
    "down 576x1536": (576, 1536, 4),
    "head 49152x576": (49152, 576, 8),
}


def _ms(call: Callable[[], torch.Tensor], repeats: int) -> float:
    for _ in range(3):
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e3


def _kernels(out: int, inp: int, bits: int, x: torch.Tensor) -> dict[str, Callable]:
    weight = (torch.randn(out, inp) * 0.02).bfloat16()
    dense = weight.T.contiguous()
    kernels: dict[str, Callable] = {"bf16 GEMM": lambda: x @ dense}
    if bits == 4:
        layer = Int4Linear(weight, None)
        args = (layer.weight, layer.scales_and_zeros)
        kernels["pytorch"] = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, layer.weight, GROUP_SIZE, layer.scales_and_zeros
        )
        kernels["dequantize + GEMM"] = lambda: x @ layer.dequantized_transposed()
        ours = torch.ops.sluice.int4_gemm if vnni_gemm.available() else None
    else:
        layer = Int8Linear(weight, None)
        codes = layer.codes()
        kernels["pytorch"] = lambda: torch.ops.aten._weight_int8pack_mm(x, codes, layer.scale)
        args = (layer.pack, layer.sums, layer.scale)
        ours = torch.ops.sluice.int8_gemm if vnni_gemm.available() else None
    if ours is not None:
        kernels["vnni"] = lambda: ours(x, *args)
    return kernels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,32")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"VNNI kernels {'on' if vnni_gemm.available() else 'off'}"
    )
    print(
        f"{'projection':<18} {'rows':>4} {'pytorch':>9} {'vnni':>9} {'ratio':>7} "
        f"{'bf16 GEMM':>10} {'dequantize + GEMM':>18}"
    )
    for name, (out, inp, bits) in SHAPES.items():
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, inp).bfloat16()
            times = {k: _ms(call, args.repeats) for k, call in _kernels(out, inp, bits, x).items()}
            ours = times.get("vnni", float("nan"))
            print(
                f"{name:<18} {rows:>4} {times['pytorch']:>9.3f} {ours:>9.3f} "
                f"{times['pytorch'] / ours:>6.2f}x {times['bf16 GEMM']:>10.3f} "
                f"{times.get('dequantize + GEMM', float('nan')):>18.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
