"""The contract between the model and an attention backend.

The model runner describes each step's flattened batch once (``plan``); every
layer then hands its new queries, keys and values to ``forward``, which writes
the keys and values into the paged cache and attends over each sequence's
whole context.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class KVCache:
    """Keys and values of every layer, ``[layers, slots, kv_heads, head_dim]``.

    Slot ``block * block_size + offset`` holds one token.
    """

    k: torch.Tensor
    v: torch.Tensor
    block_size: int

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        return cls(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
            block_size,
        )

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


@dataclass(slots=True)
class BatchLayout:
    """One step's batch: sequences in order, their new tokens laid end to end.

    Sequences with a single new token come first, so decodes form one slice.
    """

    query_lens: list[int]
    context_lens: list[int]  # tokens in the cache once this step's are written
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token

    @property
    def num_decodes(self) -> int:
        count = 0
        for query_len in self.query_lens:
            if query_len != 1:
                break
            count += 1
        return count


class AttentionBackend(ABC):
    name: str  # what the engine's start line calls it

    def __init__(self, kv_cache: KVCache):
        self.kv_cache = kv_cache

    @abstractmethod
    def plan(self, layout: BatchLayout) -> None:
        """Precompute whatever every layer of this step shares."""

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q ``[tokens, heads, dim]``, k/v ``[tokens, kv_heads, dim]``; returns q's shape."""
