"""BlockManager: page accounting, prefix reuse through chained hashes, LRU eviction.

No model: sequences are plain token lists, and "computing" a sequence is
setting ``num_computed_tokens`` and calling ``commit``, as the engine does
after each step.
"""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.sequence import Sequence
from shared.prefix_hash import chain_hash
from shared.sampling import SamplingParams

BS = 4  # block size: small, so that block boundaries are easy to see


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence(f"s{tokens[:3]}", list(tokens), SamplingParams())


def computed(bm: BlockManager, tokens: list[int]) -> Sequence:
    """A sequence admitted, given blocks for all its tokens, computed and committed."""
    seq = make_seq(tokens)
    seq.num_computed_tokens = bm.admit(seq)
    bm.grow(seq, len(seq))
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)
    return seq


def held(bm: BlockManager) -> int:
    return bm.num_blocks - bm.num_free_blocks


def test_grow_takes_ceil_blocks_and_release_returns_them() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(list(range(100, 105)))  # 5 tokens → 2 blocks
    assert bm.blocks_needed(seq, 5) == 2
    bm.grow(seq, 5)
    assert len(seq.block_table) == 2 and len(set(seq.block_table)) == 2
    assert bm.num_free_blocks == 6
    assert bm.blocks_needed(seq, 8) == 0  # the second block still has room
    assert bm.blocks_needed(seq, 9) == 1
    bm.grow(seq, 9)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.grow(seq, 9)  # idempotent: nothing more needed
    assert bm.num_free_blocks == 5

    bm.release(seq)
    assert seq.block_table == [] and seq.block_hashes == []
    assert bm.num_free_blocks == bm.num_blocks


def test_can_grow_reports_exhaustion() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    first, second = make_seq([1] * 8), make_seq([2] * 8)
    bm.grow(first, 8)
    assert bm.can_grow(second, 4)
    assert not bm.can_grow(second, 5)  # would need 2 blocks, 1 is free
    bm.grow(second, 4)
    assert bm.num_free_blocks == 0
    assert not bm.can_grow(second, 5)
    bm.release(first)
    assert bm.can_grow(second, 12)


def test_no_leak_over_many_allocations() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    for round_ in range(20):
        seqs = [make_seq([round_ * 7 + i] * (3 + i)) for i in range(6)]
        for seq in seqs:
            seq.num_computed_tokens = bm.admit(seq)
            bm.grow(seq, len(seq))
            seq.num_computed_tokens = len(seq)
            bm.commit(seq)
        assert held(bm) == sum(len(s.block_table) for s in seqs)
        for seq in seqs[::2] + seqs[1::2]:
            bm.release(seq)
        assert bm.num_free_blocks == bm.num_blocks
        assert all(block.ref_count == 0 for block in bm.blocks)


def test_admit_hits_committed_prefix() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    prefix = list(range(10, 18))  # two full blocks
    first = computed(bm, prefix + [50, 51, 52])
    assert len(first.block_hashes) == 2  # only the full blocks are committed

    second = make_seq(prefix + [60, 61])
    cached = bm.admit(second)
    assert cached == 8
    assert second.block_table == first.block_table[:2]  # the same pages, shared
    assert second.block_hashes == first.block_hashes
    assert bm.blocks[first.block_table[0]].ref_count == 2

    bm.release(first)
    assert bm.num_free_blocks == bm.num_blocks - 2  # the shared prefix is still held
    bm.release(second)
    assert bm.num_free_blocks == bm.num_blocks


def test_partial_block_is_not_committed() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(list(range(30, 37)))  # 7 tokens
    bm.grow(seq, 7)
    seq.num_computed_tokens = 3
    bm.commit(seq)
    assert seq.block_hashes == []  # the first block is not full yet
    seq.num_computed_tokens = 7
    bm.commit(seq)
    assert len(seq.block_hashes) == 1
    assert bm.admit(make_seq(list(range(30, 37)) + [99])) == 4


def test_uncommitted_blocks_are_not_hits() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(list(range(8)) + [9])
    bm.grow(seq, len(seq))  # slots given, but nothing computed yet
    assert bm.admit(make_seq(list(range(8)) + [9])) == 0


def test_chain_hash_depends_on_parent() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    shared_block = [7, 7, 7, 7]
    first = computed(bm, [1, 2, 3, 4] + shared_block + [0])
    assert first.block_hashes[1] == chain_hash(first.block_hashes[0], shared_block)
    assert first.block_hashes[1] != chain_hash(None, shared_block)

    # The same four tokens at the start of a prompt are a different prefix.
    assert bm.admit(make_seq(shared_block + [5, 5, 5, 5, 0])) == 0
    # And under a different first block too.
    other = make_seq([9, 9, 9, 9] + shared_block + [0])
    assert bm.admit(other) == 0
    assert other.block_table == []


def test_prompt_fully_cached_still_leaves_a_token_to_compute() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    tokens = list(range(40, 48))  # exactly two blocks
    computed(bm, tokens + [1, 2, 3])

    same = make_seq(tokens)
    cached = bm.admit(same)
    assert cached == 4  # the second block holds the last token: computed again
    assert len(same) - cached >= 1

    one_more = make_seq(tokens + [1])
    assert bm.admit(one_more) == 8
    assert len(one_more) - 8 == 1


def test_single_block_prompt_is_never_cached_whole() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    computed(bm, [5, 6, 7, 8, 9])
    assert bm.admit(make_seq([5, 6, 7, 8])) == 0


def _fill_and_free(bm: BlockManager) -> tuple[list[int], list[int], list[int], list[int]]:
    """Two computed two-block sequences holding every block; ``a`` is freed before ``b``.

    Returns a's tokens and blocks, then b's.
    """
    a_tokens, b_tokens = [1, 1, 1, 1, 2, 2, 2, 2], [3, 3, 3, 3, 4, 4, 4, 4]
    a, b = computed(bm, a_tokens), computed(bm, b_tokens)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    assert bm.num_free_blocks == 0
    bm.release(a)
    bm.release(b)
    assert bm.num_free_blocks == bm.num_blocks
    return a_tokens, a_blocks, b_tokens, b_blocks


def _hits(bm: BlockManager, tokens: list[int]) -> int:
    probe = make_seq(tokens + [0])
    cached = bm.admit(probe)
    bm.release(probe)
    return cached


def test_lru_evicts_least_recently_freed_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a_tokens, a_blocks, b_tokens, b_blocks = _fill_and_free(bm)
    a_tail_hash = chain_hash(chain_hash(None, a_tokens[:4]), a_tokens[4:])
    assert bm.cached[a_tail_hash] == a_blocks[1]

    newcomer = make_seq([8] * 12)
    bm.grow(newcomer, 4)
    # a was freed first, and a sequence frees its tail before its head.
    assert newcomer.block_table == [a_blocks[1]]
    assert bm.blocks[a_blocks[1]].hash is None
    assert a_tail_hash not in bm.cached

    bm.grow(newcomer, 8)
    assert newcomer.block_table == [a_blocks[1], a_blocks[0]]
    bm.grow(newcomer, 12)
    assert newcomer.block_table == [a_blocks[1], a_blocks[0], b_blocks[1]]

    assert _hits(bm, a_tokens) == 0
    assert _hits(bm, b_tokens) == 4  # b's head survived
    bm.release(newcomer)
    assert bm.num_free_blocks == bm.num_blocks


def test_evicted_prefix_no_longer_hits() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a_tokens, _, b_tokens, _ = _fill_and_free(bm)
    assert _hits(bm, a_tokens) == 8 and _hits(bm, b_tokens) == 8
    hog = make_seq([8] * 16)
    bm.grow(hog, 16)  # every block taken fresh
    assert bm.cached == {}
    assert all(block.hash is None for block in bm.blocks)
    bm.release(hog)
    assert _hits(bm, a_tokens) == 0
    assert _hits(bm, b_tokens) == 0


def test_revived_blocks_move_to_the_back_of_the_lru() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a_tokens, a_blocks, b_tokens, b_blocks = _fill_and_free(bm)
    reader = make_seq(a_tokens + [0])
    assert bm.admit(reader) == 8  # revives a's blocks...
    assert reader.block_table == a_blocks
    assert bm.num_free_blocks == 2
    bm.release(reader)  # ...and frees them again, now the most recent

    newcomer = make_seq([8] * 8)
    bm.grow(newcomer, 8)
    assert sorted(newcomer.block_table) == sorted(b_blocks)
    assert _hits(bm, a_tokens) == 8
    assert _hits(bm, b_tokens) == 0


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    first = computed(bm, list(range(9)))
    assert first.block_hashes == [] and bm.cached == {}
    assert bm.admit(make_seq(list(range(9)))) == 0
    bm.release(first)
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("length", [1, 4, 5, 8, 9, 16, 17])
def test_admit_counts_whole_blocks_below_the_last_token(length: int) -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    tokens = list(range(200, 200 + length))
    computed(bm, tokens + [0] * BS)
    probe = make_seq(tokens)
    cached = bm.admit(probe)
    assert cached == (length - 1) // BS * BS
    assert cached % BS == 0 and cached < length


def test_tracked_changes_name_what_was_cached_and_what_was_dropped() -> None:
    """What a worker's cache summary mirrors: hashes as they become revivable and as they go."""
    bm = BlockManager(num_blocks=4, block_size=BS)
    first = computed(bm, list(range(10, 19)))  # 2 full blocks, one partial
    bm.release(first)
    before = set(bm.cached)
    assert len(before) == 2 and not bm.take_changes()  # nothing recorded before tracking

    bm.track_changes()
    assert bm.take_changes().added == before  # tracking starts from what is cached
    second = computed(bm, list(range(50, 63)))  # 3 full blocks + 1 partial: evicts both
    changes = bm.take_changes()
    assert changes.dropped == before
    assert changes.added == set(bm.cached) and len(changes.added) == 3
    assert not bm.take_changes()  # taken: nothing until the next change
    bm.release(second)

    bm.take_changes()
    third = computed(bm, list(range(90, 95)))  # 1 block: evicts one cached just now
    bm.release(third)
    computed(bm, list(range(70, 83)))  # evicts the block the third just cached
    changes = bm.take_changes()
    short_lived = chain_hash(None, list(range(90, 94)))  # cached and dropped between two takes
    assert short_lived in changes.dropped and short_lived not in changes.added
    assert changes.added <= set(bm.cached) and not changes.dropped & set(bm.cached)
