"""Decode steps on a CPU as one compiled graph.

A batch-1 decode step of a small model is a few hundred small ops, and in
eager mode each one returns to Python between kernels: the dispatch costs
about as much as the kernels. ``torch.compile`` with inductor's C++ wrapper
runs the whole forward pass from one C++ function, with the elementwise work
between the matmuls (norms, rotary, residuals, SiLU, casts) fused into a few
loops, and it releases the GIL while it runs.

Attention is in the graph too, as pure reads of the paged KV cache: each
sequence attends to the blocks its table names (the slots before its new
token; the mask hides the rest) and to its new key and value, which the graph
returns. One ``index_copy_`` per cache then writes every layer's new keys and
values after the graph, so the graph mutates nothing. The graph ends with the
head: it returns every row's float32 logits, and the head's matmul is
autotuned with the rest.

Three graphs serve every decode batch: one for a single sequence, one for
``2..MANY_ROWS - 1`` sequences and one for ``MANY_ROWS..MAX_ROWS``; each takes
any context (block tables are padded to at least two blocks, so that their
width is never specialized). Prefill chunks and larger batches run eagerly.

The weights are frozen into the graphs as constants, and inductor autotunes
the matmuls of the single-sequence and many-rows graphs between ATen's
kernels and its own C++ templates. With AMX its low-bit templates run 32 rows
3-7x faster than ATen's int4 and int8 kernels but lose below about 8 rows,
hence the many-rows graph, compiled at ``MANY_ROWS_HINT`` rows. The graph for
a few rows is not autotuned: inductor keys its autotuning by the symbolic
shape, not the batch it measured, so the many-rows graph would inherit the
few-rows choice. The templates keep their own repacked copy of the weights
they take (about 95 MiB for the default model), since prefill steps still
read the model's.

Inductor keeps what it compiled in ``TORCHINDUCTOR_CACHE_DIR`` (set by
``engine/__init__.py``), so only a machine's first start pays for the C++
compiler.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.attention import BatchLayout, KVCache
from engine.attention.torch_backend import attend_decode, gather_blocks, padded_tables
from engine.model.llama import LlamaForCausalLM
from shared.heap import return_free_memory

log = logging.getLogger(__name__)

MAX_ROWS = 64
"""The largest decode batch the compiled graph takes; beyond it a step is GEMM-bound."""

MANY_ROWS = 8
"""Decode batches from this size run in the many-rows graph."""

MANY_ROWS_HINT = 32
"""The batch the many-rows graph is compiled and autotuned with."""

_AUTOTUNED = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
_FREEZING = torch._inductor.config.patch(freezing=True)  # dynamo reads it while tracing

_MIN_BLOCKS = 2
"""Block tables are padded to this width: dynamo would specialize a width of 1."""


def _compiled(function: Callable, autotuned: bool) -> Callable:
    options = {"cpp_wrapper": True} | (_AUTOTUNED if autotuned else {})
    return torch.compile(function, fullgraph=True, options=options)


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
        keys = self._context(self.k_cache[layer], k, q.dtype)
        values = self._context(self.v_cache[layer], v, q.dtype)
        return attend_decode(q, keys, values, self.mask)

    def _context(self, slots: torch.Tensor, new: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Each row's blocks, then its new slot: ``[rows, blocks * block_size + 1, heads, dim]``."""
        blocks = slots.view(-1, self.block_size, *slots.shape[1:])
        gathered = gather_blocks(blocks, self.tables, dtype)
        return torch.cat((gathered, new.unsqueeze(1).to(dtype)), dim=1)


class CompiledDecode:
    """``model``'s forward pass over decode batches of up to ``MAX_ROWS`` sequences."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, max_num_seqs: int):
        """``max_num_seqs``: the engine's batch limit; graphs for larger batches are not built."""
        self.model = model
        self.kv_cache = kv_cache
        self.max_rows = min(MAX_ROWS, max_num_seqs)
        self.steps = 0  # decode steps it ran, warm-up included
        # A function each, so that dynamo keeps a cache each.
        self._one = _compiled(self._run_one, autotuned=True)
        self._few = _compiled(self._run_few, autotuned=False)
        self._many = _compiled(self._run_many, autotuned=True)

    def takes(self, layout: BatchLayout) -> bool:
        """Whether this step is a decode batch the graph serves."""
        rows = len(layout.query_lens)
        return rows <= self.max_rows and layout.num_decodes == rows

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout
    ) -> torch.Tensor:
        """Float32 logits of every row; the step's keys and values land in the cache."""
        self.steps += 1
        tables, mask = self._context(layout)
        rows = len(input_ids)
        if rows > 1:
            for tensor in (input_ids, positions, tables, mask):
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
        torch._dynamo.maybe_mark_dynamic(tables, 1)
        torch._dynamo.maybe_mark_dynamic(mask, 3)
        cache = self.kv_cache
        forward = self._one if rows == 1 else self._few if rows < MANY_ROWS else self._many
        with _FREEZING:
            logits, keys, values = forward(input_ids, positions, tables, mask, cache.k, cache.v)
        cache.k.index_copy_(1, layout.slot_mapping, keys)
        cache.v.index_copy_(1, layout.slot_mapping, values)
        return logits

    def _run_one(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._run(*inputs)

    def _run_few(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._run(*inputs)

    def _run_many(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._run(*inputs)

    def _run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        tables: torch.Tensor,
        mask: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        reads = _CacheReads(k_cache, v_cache, tables, mask, self.kv_cache.block_size)
        hidden = self.model(input_ids, positions, reads)  # type: ignore[arg-type]
        logits = self.model.compute_logits(hidden)
        return logits, torch.stack(reads.new_keys), torch.stack(reads.new_values)

    def _context(self, layout: BatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables ``[rows, blocks]`` of the slots before each new token, and the
        additive mask ``[rows, 1, 1, blocks * block_size + 1]`` over them and the new one."""
        before = [length - 1 for length in layout.context_lens]
        tables, mask = padded_tables(
            layout.block_tables, before, self.kv_cache.block_size, _MIN_BLOCKS
        )
        mask = F.pad(mask, (0, 1))  # the new token's own column: always seen
        return tables, mask[:, None, None, :]

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile the graphs the batch limit allows now, on the thread that will step the model.

        Each runs once on slot 0, which nothing has written yet and every
        sequence writes before it reads.
        """
        start = time.perf_counter()
        batches = [1]
        if self.max_rows >= 2:
            batches.append(2)
        if self.max_rows >= MANY_ROWS:
            batches.append(min(MANY_ROWS_HINT, self.max_rows))
        for batch in batches:
            layout = BatchLayout(
                query_lens=[1] * batch,
                context_lens=[1] * batch,
                block_tables=[[0]] * batch,
                slot_mapping=torch.zeros(batch, dtype=torch.long),
            )
            zeros = (torch.zeros(batch, dtype=torch.long) for _ in range(2))
            self(*zeros, layout)
        gc.collect()  # compiling leaves tens of MB of garbage and freed heap behind
        return_free_memory()
        log.info("compiled the decode step in %.1f s", time.perf_counter() - start)
