"""The prefix hash chain: the same in every process, the engine's own, and exactly specified."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from api.backends.placement import prompt_chains
from engine.block_manager import BlockManager
from engine.sequence import Sequence
from shared.prefix_hash import ImageSpan, chain_hash, digest, prefix_hashes
from shared.registry import default_registry
from shared.sampling import SamplingParams
from shared.tokenizer_loader import load_tokenizer
from shared.wire import WorkerLoad

ROOT = Path(__file__).resolve().parents[2]
TOKENS = [1, 49151, 0, 7, 12345, 2**31, 42, 9, 8, 7, 6, 5, 4, 3, 2, 1, 100]  # 4 full blocks of 4


def test_a_block_s_hash_is_blake2b_of_its_parent_and_its_tokens() -> None:
    """Spelled out on its own: a 16-byte BLAKE2b of the parent's digest and little-endian u32s."""
    first = hashlib.blake2b(bytes(16) + struct.pack("<4I", *TOKENS[:4]), digest_size=16)
    second = hashlib.blake2b(first.digest() + struct.pack("<4I", *TOKENS[4:8]), digest_size=16)
    chain = prefix_hashes(TOKENS, 4)
    assert len(chain) == 4  # the 17th token is in no full block
    assert chain[0] == int.from_bytes(first.digest(), "little")
    assert chain[1] == int.from_bytes(second.digest(), "little")


def test_the_chain_is_the_same_in_another_process_with_another_hash_seed() -> None:
    script = f"from shared.prefix_hash import prefix_hashes; print(prefix_hashes({TOKENS}, 4))"
    outputs = {
        subprocess.run(
            [sys.executable, "-c", script],
            cwd=ROOT,
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outputs == {str(prefix_hashes(TOKENS, 4))}


def test_equal_blocks_under_other_parents_hash_differently() -> None:
    block = TOKENS[:4]
    assert chain_hash(None, block) == chain_hash(None, list(block))
    assert chain_hash(None, block) != chain_hash(chain_hash(None, block), block)
    assert chain_hash(None, block) != chain_hash(None, block[::-1])


@pytest.mark.parametrize("block_size", [4, 16])
def test_the_chain_is_the_engine_s_for_prompts_of_the_corpus(block_size: int) -> None:
    """What the API's placement computes for a prompt is what the engine's prefix cache names."""
    from bench.corpus import chats

    tokenizer = load_tokenizer(default_registry().resolve("default").tokenizer).tokenizer
    manager = BlockManager(num_blocks=4096, block_size=block_size)
    for index, chat in enumerate(chats(40)):
        text = "\n".join(str(message.get("content")) for message in chat.messages)
        token_ids = tokenizer.encode(text).ids
        seq = Sequence(f"chat-{index}", token_ids, SamplingParams())
        seq.num_computed_tokens = manager.admit(seq)
        manager.grow(seq, len(seq))
        seq.num_computed_tokens = len(seq)
        manager.commit(seq)
        assert seq.block_hashes == prefix_hashes(token_ids, block_size)
        usable = (len(token_ids) - 1) // block_size  # what the engine's ``admit`` can reuse
        placed = prompt_chains(token_ids, [WorkerLoad("w", "m", block_size=block_size)])
        assert placed[block_size] == [digest(h) for h in seq.block_hashes[:usable]]
        manager.release(seq)


def test_images_enter_the_hash_of_the_blocks_they_overlap() -> None:
    """The engine and the API's placement hash an image's blocks alike, by its digest."""
    block_size, token_ids = 4, list(range(20))
    image = ImageSpan(start=5, end=11, digest=bytes(16))  # blocks 1 and 2 of 0..4
    other = ImageSpan(5, 11, bytes([1]) * 16)
    manager = BlockManager(num_blocks=64, block_size=block_size)
    seq = Sequence("pictured", token_ids, SamplingParams())
    seq.images = [image]
    manager.grow(seq, len(seq))
    seq.num_computed_tokens = len(seq)
    manager.commit(seq)
    assert seq.block_hashes == prefix_hashes(token_ids, block_size, [image])
    plain, pictured = prefix_hashes(token_ids, block_size), seq.block_hashes
    different = prefix_hashes(token_ids, block_size, [other])
    assert pictured[0] == plain[0] == different[0]  # before the image
    assert len({plain[1], pictured[1], different[1]}) == 3  # the image's blocks, and every later
    assert len({plain[4], pictured[4], different[4]}) == 3
    placed = prompt_chains(token_ids, [WorkerLoad("w", "m", block_size=block_size)], [image])
    assert placed[block_size] == [digest(h) for h in pictured[:4]]
