"""Compiles the decode graphs ahead of time, in a process of its own.

``python -m engine.decode_compiler MODEL SPEC OUT`` loads the model that
``torch.save`` wrote to MODEL, exports each decode graph SPEC names
(``torch.export``) and compiles it with AOTInductor, leaving in OUT a shared
library and the constants compiling made (``engine.compiled.graph_files``).
The serving process only loads those, so it never imports dynamo or inductor
and keeps none of what compiling leaves behind; see ``engine.compiled`` for
the graphs and why.

Each graph is one decode step: the model's forward pass over one new token per
row, attention included as pure reads of the paged KV cache (each row attends
to the blocks its table names, the mask hiding the slots past its context, and
to its own new key and value; ``engine.attention.paged_decode``'s kernel where
it runs), then the head. It returns every row's float32 logits and every
layer's new keys and values; the caller writes those into the cache, so the
graph mutates nothing. The weights are frozen into the graph, and inductor
rounds to bfloat16 wherever an eager step does (``emulate_precision_casts``), so
that a row's logits are the bits an eager step gives it. Only the constants
compiling made are kept; the model's own tensors are handed to the graph when it is
loaded, so they are held once.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import signal
import sys
import zipfile
from pathlib import Path

import torch
from torch import nn
from torch.export import Dim

from engine.attention import KVCache, paged_decode
from engine.attention.torch_backend import attend_decode, gather_blocks
from engine.compiled import (
    COMPILE_PARENT_ENV,
    MAX_ROWS,
    MIN_BLOCKS,
    Graph,
    context,
    graph_files,
    model_tensors,
)

EXAMPLE_TABLE_BLOCKS = MAX_ROWS + 1
EXAMPLE_CACHE_BLOCKS = MAX_ROWS + 2
"""The example's block tables are this wide and its KV cache this many blocks: sizes no batch
shares, so export never takes the batch dimension for one of theirs."""

MAX_BLOCKS = 1 << 20
"""The most blocks a table or the KV cache may hold: far beyond any context or memory."""

WEIGHTS_CONFIG = "data/aotinductor/model/weights_config.json"
"""Where a package lists its constants: name → [file under data/weights, shape, stride, ...]."""

_PACKAGE = {
    "emulate_precision_casts": True,
    "cpp.weight_prepack": False,  # a dense layer runs ATen's GEMM, as an eager step does
    "freezing": True,
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "pickle_weights",
}


class _CacheReads:
    """The attention backend the model calls inside the graph; see the module docstring."""

    def __init__(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        mask: torch.Tensor,
        block_size: int,
    ):
        self.k_cache, self.v_cache = k_cache, v_cache
        self.tables, self.mask, self.block_size = tables, mask, block_size
        self.new_keys: list[torch.Tensor] = []
        self.new_values: list[torch.Tensor] = []

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # Stored as the cache stores them, and attended to as eager steps read them back.
        k, v = k.to(self.k_cache.dtype), v.to(self.v_cache.dtype)
        self.new_keys.append(k)
        self.new_values.append(v)
        k_blocks, v_blocks = (self._blocks(cache[layer]) for cache in (self.k_cache, self.v_cache))
        if paged_decode.serves(q, k_blocks):
            return paged_decode.attend(q, k_blocks, v_blocks, self.tables, self.mask, (k, v))
        keys = self._context(k_blocks, k, q.dtype)
        values = self._context(v_blocks, v, q.dtype)
        return attend_decode(q, keys, values, self.mask)

    def _blocks(self, slots: torch.Tensor) -> torch.Tensor:
        """One layer's slots as whole blocks ``[blocks, block_size, heads, dim]``."""
        return slots.view(-1, self.block_size, *slots.shape[1:])

    def _context(self, blocks: torch.Tensor, new: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Each row's blocks, then its new slot: ``[rows, blocks * block_size + 1, heads, dim]``."""
        gathered = gather_blocks(blocks, self.tables, dtype)
        return torch.cat((gathered, new.unsqueeze(1).to(dtype)), dim=1)


class DecodeStep(nn.Module):
    """One decode step of ``model``: ``(input_ids, positions, tables, mask, k_cache, v_cache)``
    → ``(logits, new keys, new values)``, keys and values ``[layers, rows, heads, dim]``."""

    def __init__(self, model: nn.Module, block_size: int):
        super().__init__()
        self.model = model
        self.block_size = block_size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        tables: torch.Tensor,
        mask: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        reads = _CacheReads(k_cache, v_cache, tables, mask, self.block_size)
        hidden = self.model(input_ids, positions, reads)
        logits = self.model.compute_logits(hidden)
        return logits, torch.stack(reads.new_keys), torch.stack(reads.new_values)


def compile_graph(step: DecodeStep, graph: Graph, kv_dtype: torch.dtype, out: Path) -> None:
    """Export ``step`` for ``graph``'s batch sizes and any context and cache, and compile it
    into ``out``, a package that ``_unpack`` takes apart. Export fails, rather than
    specialize, if the model fixes a dynamic size."""
    cfg, block_size = step.model.cfg, step.block_size
    cache = KVCache.allocate(
        cfg.num_layers,
        EXAMPLE_CACHE_BLOCKS,
        block_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        kv_dtype,
        torch.device("cpu"),
    )
    tables, mask = context(
        [[0] * EXAMPLE_TABLE_BLOCKS] * graph.rows,
        [EXAMPLE_TABLE_BLOCKS * block_size] * graph.rows,
        block_size,
    )
    ids = torch.zeros(graph.rows, dtype=torch.long)
    rows = {0: Dim("rows", min=graph.least, max=graph.most)} if graph.most > 1 else {}
    blocks = Dim("blocks", min=MIN_BLOCKS, max=MAX_BLOCKS)
    slots = {1: block_size * Dim("cache_blocks", min=1, max=MAX_BLOCKS)}
    dynamic = (rows, rows, rows | {1: blocks}, rows | {3: block_size * blocks + 1}, slots, slots)
    with torch.inference_mode():
        program = torch.export.export(
            step, (ids, ids.clone(), tables, mask, cache.k, cache.v), dynamic_shapes=dynamic
        )
    torch._inductor.aoti_compile_and_package(
        program, package_path=str(out), inductor_configs=_PACKAGE
    )


def _unpack(package: Path, name: str, own: set[str]) -> None:
    """Keep ``package``'s shared library and the constants compiling made (those not in
    ``own``) as ``graph_files(package.parent, name)``, and delete the package.

    PyTorch's package loader would extract the library to a temporary directory at
    every start, and leave it behind unless the loader is destroyed before the process
    exits; the runner loads it in place.
    """
    library, made_file = graph_files(package.parent, name)
    with zipfile.ZipFile(package) as archive:
        root = archive.namelist()[0].split("/")[0]
        [so] = [item for item in archive.namelist() if item.endswith(".so")]
        library.write_bytes(archive.read(so))
        calls = so.removesuffix(".so") + ".json"  # the custom ops the graph calls, if any
        if calls in archive.namelist():  # the runner reads it from beside the library
            library.with_suffix(".json").write_bytes(archive.read(calls))
        config = json.loads(archive.read(f"{root}/{WEIGHTS_CONFIG}"))
        made = {
            fqn: torch.load(io.BytesIO(archive.read(f"{root}/data/weights/{file}")))
            for fqn, (file, *_) in config.items()
            if fqn not in own
        }
    torch.save(made, made_file)
    package.unlink()


def main(model_file: str, spec_file: str, out_dir: str) -> None:
    _end_with_the_parent()
    spec = json.loads(Path(spec_file).read_text())
    torch.set_num_threads(spec["threads"])
    model = torch.load(model_file, weights_only=False)
    step = DecodeStep(model, spec["block_size"]).eval()
    kv_dtype = getattr(torch, spec["kv_dtype"])
    out = Path(out_dir)
    own = set(model_tensors(model))
    for name, graph in spec["graphs"].items():
        package = out / f"{name}.pt2"
        compile_graph(step, Graph(**graph), kv_dtype, package)
        _unpack(package, name, own)


_PR_SET_PDEATHSIG = 1


def _end_with_the_parent() -> None:
    """Be killed when the process that asked for the compile ends (Linux): a server stopped
    during a background compile leaves no compile running on its cores."""
    parent = os.environ.get(COMPILE_PARENT_ENV)
    if not sys.platform.startswith("linux") or parent is None:
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(parent):  # it ended before the request took effect
        sys.exit(1)


if __name__ == "__main__":
    main(*sys.argv[1:])
