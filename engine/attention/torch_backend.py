"""Paged attention in plain PyTorch: works on CPU and CUDA.

Where ``paged_decode``'s kernel runs (a CPU with AVX-512), every query row of a
step attends through it: a decode's token, and each token of a prefill chunk,
whose context is its sequence's slots up to its own, which the cache holds by
then. One kernel with one order of reduction for every row makes a token's
attention the same bits whether it is decoded, prefilled in a chunk of any
length, recomputed after a resume or continued from a cached prefix, and it
reads each sequence's context where the cache holds it. The block tables and
masks are built once in ``plan`` and reused by every layer.

Elsewhere decodes attend over their context gathered into a padded
``[batch, context, kv_heads, dim]`` tensor, whole blocks at a time, and prefill
chunks attend one sequence at a time with ``scaled_dot_product_attention``; a
chunk with no cached prefix attends to its own keys without touching the cache.
The cache may store a narrower dtype than the model computes in (bfloat16 under
a float32 model with low-bit layers); keys and values are cast on the way in
and out, and attention computes in the queries' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import paged_decode
from engine.attention.base import AttentionBackend, BatchLayout, KVCache


@dataclass(slots=True)
class _Prefill:
    start: int  # first token in the flattened batch
    end: int
    cached: int  # context tokens before this chunk
    gather: torch.Tensor | None  # [1, blocks] of the whole context, when cached > 0
    mask: torch.Tensor | None


@dataclass(slots=True)
class _Plan:
    slot_mapping: torch.Tensor
    decode_rows: int  # the decodes, then, where the kernel runs, every prefill token
    decode_gather: torch.Tensor | None  # [decode_rows, max_blocks] block tables, zero-padded
    decode_mask: torch.Tensor | None  # [decode_rows, 1, 1, max_context], additive
    prefills: list[_Prefill]  # the chunks that attend alone


class TorchBackend(AttentionBackend):
    name = "torch"

    def __init__(self, kv_cache: KVCache):
        super().__init__(kv_cache)
        # Per layer: the cache's slots, and the same memory as whole blocks
        # [blocks, block_size, kv_heads, dim]; taken once, not on every call.
        self._slots = list(zip(kv_cache.k, kv_cache.v, strict=True))
        self._blocks = [
            tuple(c.view(-1, kv_cache.block_size, *c.shape[1:]) for c in pair)
            for pair in self._slots
        ]

    def plan(self, layout: BatchLayout) -> None:
        device = layout.slot_mapping.device
        tables, lengths, joined = self._decode_rows(layout)
        gather = mask = None
        if lengths:
            gather, mask = padded_tables(tables, lengths, self.kv_cache.block_size)
            gather, mask = gather.to(device), mask[:, None, None, :].to(device)
        prefills = []
        start = len(lengths)
        for i in range(layout.num_decodes + joined, len(layout.query_lens)):
            end = start + layout.query_lens[i]
            cached = layout.context_lens[i] - layout.query_lens[i]
            prefills.append(self._prefill(layout, i, start, end, cached, device))
            start = end
        self._plan = _Plan(layout.slot_mapping, len(lengths), gather, mask, prefills)

    def _decode_rows(self, layout: BatchLayout) -> tuple[list[list[int]], list[int], int]:
        """The block table and context length of each row the kernel attends, and how many
        prefill chunks are among them: where the kernel runs, all of them."""
        decodes = layout.num_decodes
        tables, lengths = layout.block_tables[:decodes], layout.context_lens[:decodes]
        if not (paged_decode.available() and layout.slot_mapping.device.type == "cpu"):
            return tables, lengths, 0
        for i in range(decodes, len(layout.query_lens)):
            query, context = layout.query_lens[i], layout.context_lens[i]
            tables += [layout.block_tables[i]] * query
            lengths += range(context - query + 1, context + 1)  # each token sees itself
        return tables, lengths, len(layout.query_lens) - decodes

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        plan = self._plan
        k_cache, v_cache = self._slots[layer]
        k_cache.index_copy_(0, plan.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, plan.slot_mapping, v.to(v_cache.dtype))
        k_blocks, v_blocks = self._blocks[layer]
        rows = plan.decode_rows
        if rows:
            decodes = self._decode(q[:rows], k_blocks, v_blocks)
            if not plan.prefills:  # nothing else to attend
                return decodes
        out = torch.empty_like(q)
        if rows:
            out[:rows] = decodes
        for chunk in plan.prefills:
            queries = q[chunk.start : chunk.end].unsqueeze(0)
            if chunk.gather is None:
                keys = k[chunk.start : chunk.end].unsqueeze(0)
                values = v[chunk.start : chunk.end].unsqueeze(0)
            else:
                keys = gather_blocks(k_blocks, chunk.gather, q.dtype)
                values = gather_blocks(v_blocks, chunk.gather, q.dtype)
            out[chunk.start : chunk.end] = _attend(queries, keys, values, chunk.mask)[0]
        return out

    def _decode(
        self, q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor
    ) -> torch.Tensor:
        """The decode rows' attention over their blocks, which already hold their new tokens
        (gathered for SDPA where the kernel does not serve these queries)."""
        plan = self._plan
        if paged_decode.serves(q, k_blocks):
            return paged_decode.attend(q, k_blocks, v_blocks, plan.decode_gather, plan.decode_mask)
        keys = gather_blocks(k_blocks, plan.decode_gather, q.dtype)
        values = gather_blocks(v_blocks, plan.decode_gather, q.dtype)
        return attend_decode(q, keys, values, plan.decode_mask)

    def _prefill(
        self,
        layout: BatchLayout,
        index: int,
        start: int,
        end: int,
        cached: int,
        device: torch.device,
    ) -> _Prefill:
        if cached == 0:
            return _Prefill(start, end, 0, None, None)
        block_size = self.kv_cache.block_size
        context = layout.context_lens[index]
        num_blocks = -(-context // block_size)
        table = torch.tensor([layout.block_tables[index][:num_blocks]], dtype=torch.long)
        positions = torch.arange(num_blocks * block_size)
        query_positions = torch.arange(cached, context).unsqueeze(1)
        mask = positions.unsqueeze(0) <= query_positions  # causal with an offset
        return _Prefill(start, end, cached, table.to(device), mask[None, None].to(device))


def padded_tables(
    block_tables: list[list[int]], lengths: list[int], block_size: int, min_blocks: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks that hold each sequence's first ``lengths`` slots, zero-padded to one width
    ``[seqs, blocks]`` (at least ``min_blocks``), and the additive mask
    ``[seqs, blocks * block_size]`` that hides the slots past each length."""
    width = max(min_blocks, -(-max(lengths) // block_size))
    distinct = {id(table): table[:width] for table in block_tables}  # a chunk's rows share one
    rows = [table + [0] * (width - len(table)) for table in distinct.values()]
    tables = torch.tensor(rows, dtype=torch.long)
    if len(distinct) < len(block_tables):
        row_of = {key: row for row, key in enumerate(distinct)}
        tables = tables[torch.tensor([row_of[id(table)] for table in block_tables])]
    past = torch.arange(width * block_size).unsqueeze(0) >= torch.tensor(lengths).unsqueeze(1)
    return tables, torch.zeros(past.shape).masked_fill_(past, float("-inf"))


def gather_blocks(blocks: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks ``tables [seqs, n]`` → ``[seqs, n * block_size, kv_heads, dim]`` in ``dtype``.

    Copying blocks (``index_select`` of contiguous rows) is an order of
    magnitude faster than gathering token by token; the mask hides the slots
    past each sequence's length.
    """
    picked = blocks.index_select(0, tables.view(-1))
    return picked.view(tables.shape[0], -1, *blocks.shape[2:]).to(dtype)


def attend_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """One query token per sequence: q ``[b, h, d]``, k/v ``[b, s, kvh, d]``.

    The query heads that share a KV head are laid out as that head's
    "sequence" of queries, so grouped-query attention needs no repeated keys.
    """
    batch, heads, dim = q.shape
    kv_heads = k.shape[2]
    grouped = q.view(batch, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(grouped, k.transpose(1, 2), v.transpose(1, 2), mask)
    return out.reshape(batch, heads, dim)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """q ``[b, n, h, d]``, k/v ``[b, s, kvh, d]`` → ``[b, n, h, d]``; causal when mask is None."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,
        enable_gqa=True,
    )
    return out.transpose(1, 2)
