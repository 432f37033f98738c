"""Decode steps on a CPU as one compiled graph.

A batch-1 decode step of a small model is a few hundred small ops, and in
eager mode each one returns to Python between kernels: the dispatch costs
about as much as the kernels. ``torch.compile`` with inductor's C++ wrapper
runs the whole forward pass from one C++ function, with the elementwise work
between the matmuls (norms, rotary, residuals, SiLU, casts) fused into a few
loops, and it releases the GIL while it runs.

Attention stays in Python, behind the ``sluice::attention`` op: it reads the
plan the runner made for the step and writes the paged KV cache, neither of
which a graph can hold. Two graphs serve every decode batch: one for a single
sequence (dynamo specializes a size of 1) and one for ``2..MAX_ROWS``
sequences. Prefill chunks and larger batches run eagerly.

Inductor keeps what it compiled in ``TORCHINDUCTOR_CACHE_DIR`` (set by
``engine/__init__.py``), so only a machine's first start pays for the C++
compiler.
"""

from __future__ import annotations

import logging
import time
from itertools import count

import torch

from engine.attention import AttentionBackend, BatchLayout
from engine.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

MAX_ROWS = 64
"""The largest decode batch the compiled graph takes; beyond it a step is GEMM-bound."""

_backends: dict[int, AttentionBackend] = {}
_keys = count()


@torch.library.custom_op("sluice::attention", mutates_args=())
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, backend: int
) -> torch.Tensor:
    """``_backends[backend].forward``: writes this layer's keys and values, attends."""
    return _backends[backend].forward(layer, q, k, v)


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, backend: int) -> torch.Tensor:
    return torch.empty_like(q)


class _AttentionOp:
    """What the model calls as its attention backend inside the graph."""

    def __init__(self, key: int):
        self.key = key

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return torch.ops.sluice.attention(q, k, v, layer, self.key)


class CompiledDecode:
    """``model``'s forward pass over decode batches of up to ``MAX_ROWS`` sequences."""

    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend):
        self.model = model
        self.backend = backend
        self.key = next(_keys)
        _backends[self.key] = backend
        self._op = _AttentionOp(self.key)
        self.steps = 0  # decode steps it ran, warm-up included
        self._forward = torch.compile(self._run, fullgraph=True, options={"cpp_wrapper": True})

    def __del__(self) -> None:
        _backends.pop(self.key, None)

    def takes(self, layout: BatchLayout) -> bool:
        """Whether this step is a decode batch the graph serves."""
        rows = len(layout.query_lens)
        return rows <= MAX_ROWS and layout.num_decodes == rows

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states of every row."""
        self.steps += 1
        if len(input_ids) > 1:  # one graph for every batch size from 2
            for tensor in (input_ids, positions):
                torch._dynamo.mark_dynamic(tensor, 0, min=2, max=MAX_ROWS)
        return self._forward(input_ids, positions)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, self._op)  # type: ignore[arg-type]

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile both graphs now, on the thread that will step the model.

        Each runs once on slot 0, which nothing has written yet and every
        sequence writes before it reads.
        """
        start = time.perf_counter()
        for batch in (1, 2):
            layout = BatchLayout(
                query_lens=[1] * batch,
                context_lens=[1] * batch,
                block_tables=[[0]] * batch,
                slot_mapping=torch.zeros(batch, dtype=torch.long),
            )
            self.backend.plan(layout)
            self(torch.zeros(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.long))
        log.info("compiled the decode step in %.1f s", time.perf_counter() - start)
