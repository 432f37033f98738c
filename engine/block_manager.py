"""Paged KV-cache bookkeeping with prefix caching.

The cache is split into blocks of ``block_size`` token slots. A full block is
identified by the hash of its tokens chained with its parent block's hash
(``shared.prefix_hash``: the same in every process, and collision-resistant),
so equal hashes mean equal prefixes. Blocks nobody references go to an LRU list
but keep their hash: a later prompt with the same prefix revives them instead
of recomputing. Fresh blocks are taken from the LRU front, dropping whatever
cached prefix they held.

Once ``track_changes`` is called, the manager also records which hashes became
revivable and which were dropped since ``take_changes`` was last called: a
worker publishes them as its cache summary, for the API to place requests
where their prefix is cached.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from engine.sequence import Sequence
from shared.prefix_hash import chain_hash, images_in


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None


@dataclass(slots=True)
class CacheChanges:
    """Hashes cached and dropped since the last ``take_changes``; the two sets are disjoint."""

    added: set[int] = field(default_factory=set)
    dropped: set[int] = field(default_factory=set)

    def add(self, block_hash: int) -> None:
        self.dropped.discard(block_hash)
        self.added.add(block_hash)

    def drop(self, block_hash: int) -> None:
        self.added.discard(block_hash)
        self.dropped.add(block_hash)

    def __bool__(self) -> bool:
        return bool(self.added or self.dropped)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
    ):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self._changes: CacheChanges | None = None  # None: not tracking

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs so that ``num_tokens`` tokens have slots."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free)

    def admit(self, seq: Sequence) -> int:
        """Attach cached prefix blocks to a sequence with no blocks yet.

        Returns the number of tokens whose KV is already cached. The last token
        is never counted, so a prefill always has at least one token to
        compute and produce logits from. A sequence still computing its prompt
        logprobs reuses nothing: they come from the prompt's own forward pass.
        """
        assert not seq.block_table
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return 0
        parent: int | None = None
        for start in range(0, len(seq) - 1 - self.block_size + 1, self.block_size):
            block_hash = self._hash(seq, parent, start)
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            self._reference(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(block_hash)
            parent = block_hash
        return len(seq.block_table) * self.block_size

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` enough blocks for ``num_tokens`` tokens (caller checked)."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._take_fresh())

    def commit(self, seq: Sequence) -> None:
        """Publish the full blocks whose KV is now computed for prefix reuse."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        for index in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            block_hash = self._hash(seq, parent, index * self.block_size)
            seq.block_hashes.append(block_hash)
            block = self.blocks[seq.block_table[index]]
            if block_hash not in self.cached:
                block.hash = block_hash
                self.cached[block_hash] = block.block_id
                if self._changes is not None:
                    self._changes.add(block_hash)

    def _hash(self, seq: Sequence, parent: int | None, start: int) -> int:
        end = start + self.block_size
        return chain_hash(parent, seq.token_ids[start:end], images_in(seq.images, start, end))

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's references; cached blocks stay revivable."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table.clear()
        seq.block_hashes.clear()

    def track_changes(self) -> None:
        """Record changes from now on, starting with every hash cached now as added."""
        self._changes = CacheChanges(added=set(self.cached))

    def take_changes(self) -> CacheChanges:
        """What was cached and dropped since the last call (nothing unless tracking)."""
        changes = self._changes
        if not changes:
            return CacheChanges()
        self._changes = CacheChanges()
        return changes

    def _reference(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            del self.cached[block.hash]
            if self._changes is not None:
                self._changes.drop(block.hash)
            block.hash = None
        block.ref_count = 1
        return block_id
