"""``paged_decode``: the kernel against SDPA over the gathered blocks."""

from __future__ import annotations

import pytest
import torch

from engine.attention import BatchLayout, KVCache, paged_decode
from engine.attention.torch_backend import (
    TorchBackend,
    attend_decode,
    gather_blocks,
    padded_tables,
)

pytestmark = pytest.mark.skipif(
    not paged_decode.available(), reason="the paged decode kernel does not run here"
)

BLOCK_SIZE = 16
NUM_BLOCKS = 40


def _case(
    lengths: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, a cache of random blocks, block tables for ``lengths`` (scattered, none
    holding block 0, which pads them) and the mask."""
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, kv_heads, dim)
    k_blocks = torch.randn(shape, generator=generator).to(dtype)
    v_blocks = torch.randn(shape, generator=generator).to(dtype)
    q = (torch.randn(len(lengths), heads, dim, generator=generator) * 2).to(dtype)
    order = (torch.randperm(NUM_BLOCKS - 1, generator=generator) + 1).tolist()  # 0 pads
    block_tables = []
    for length in lengths:
        count = -(-length // BLOCK_SIZE)
        block_tables.append(order[:count])
        order = order[count:]
    tables, mask = padded_tables(block_tables, lengths, BLOCK_SIZE, min_blocks=2)
    return q, k_blocks, v_blocks, tables, mask[:, None, None, :]


def _reference(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    tables: torch.Tensor,
    mask: torch.Tensor,
    new: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """SDPA in float32 over the gathered blocks, then the new slot."""
    keys = gather_blocks(k_blocks, tables, torch.float32)
    values = gather_blocks(v_blocks, tables, torch.float32)
    if new is not None:
        keys = torch.cat((keys, new[0].float().unsqueeze(1)), dim=1)
        values = torch.cat((values, new[1].float().unsqueeze(1)), dim=1)
    return attend_decode(q.float(), keys, values, mask)


def _tolerance(dtype: torch.dtype) -> float:
    return 2e-2 if dtype == torch.bfloat16 else 2e-5


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (14, 2, 64), (8, 1, 128)]
)
def test_it_matches_sdpa_over_the_gathered_blocks(
    q_dtype: torch.dtype, cache_dtype: torch.dtype, heads: int, kv_heads: int, dim: int
) -> None:
    lengths = [1, 5, 16, 17, 70, 33]  # within a block, on a boundary, past one, several
    q, k_blocks, v_blocks, tables, mask = _case(lengths, heads, kv_heads, dim, cache_dtype)
    q = q.to(q_dtype)
    got = paged_decode.attend(q, k_blocks, v_blocks, tables, mask)
    assert got.dtype == q_dtype and got.shape == q.shape
    expected = _reference(q, k_blocks, v_blocks, tables, mask)
    torch.testing.assert_close(got.float(), expected, atol=_tolerance(q_dtype), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_attends_to_its_new_key_and_value_after_its_blocks(dtype: torch.dtype) -> None:
    """As the compiled decode graphs call it: the new token is not in the cache yet."""
    lengths = [3, 16, 40]
    q, k_blocks, v_blocks, tables, mask = _case(lengths, 9, 3, 64, dtype, seed=1)
    new = (torch.randn(3, 3, 64).to(dtype) * 3, torch.randn(3, 3, 64).to(dtype))
    mask = torch.nn.functional.pad(mask, (0, 1))  # the new token's column: always seen
    got = paged_decode.attend(q, k_blocks, v_blocks, tables, mask, new)
    expected = _reference(q, k_blocks, v_blocks, tables, mask, new)
    torch.testing.assert_close(got.float(), expected, atol=_tolerance(dtype), rtol=0)


def test_queries_and_new_keys_may_be_slices_of_the_fused_projection() -> None:
    """The model hands over views of one [rows, heads + 2 * kv_heads, dim] tensor."""
    lengths = [7, 20]
    q, k_blocks, v_blocks, tables, mask = _case(lengths, 9, 3, 64, torch.bfloat16, seed=3)
    fused = torch.cat((q, torch.randn(2, 6, 64).bfloat16()), dim=1)
    q, new_k, new_v = fused[:, :9], fused[:, 9:12], fused[:, 12:]
    assert not q.is_contiguous() and not new_k.is_contiguous()
    mask = torch.nn.functional.pad(mask, (0, 1))
    got = paged_decode.attend(q, k_blocks, v_blocks, tables, mask, (new_k, new_v))
    contiguous = (new_k.contiguous(), new_v.contiguous())
    expected = paged_decode.attend(q.contiguous(), k_blocks, v_blocks, tables, mask, contiguous)
    assert got.is_contiguous() and torch.equal(got, expected)


def test_slots_the_mask_hides_are_never_read() -> None:
    """Past each row's length, and in block 0 that pads the tables, the cache holds NaN."""
    lengths = [5, 30]
    q, k_blocks, v_blocks, tables, mask = _case(lengths, 9, 3, 64, torch.bfloat16, seed=2)
    expected = _reference(q, k_blocks, v_blocks, tables, mask)
    for blocks in (k_blocks, v_blocks):
        blocks[0] = float("nan")
        for row, length in enumerate(lengths):
            last = tables[row, (length - 1) // BLOCK_SIZE]
            blocks[last, (length - 1) % BLOCK_SIZE + 1 :] = float("nan")
    got = paged_decode.attend(q, k_blocks, v_blocks, tables, mask)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=0)


def test_a_row_that_sees_nothing_gets_zeros() -> None:
    q, k_blocks, v_blocks, tables, mask = _case([4, 4], 9, 3, 64, torch.float32)
    mask[1] = float("-inf")
    got = paged_decode.attend(q, k_blocks, v_blocks, tables, mask)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    torch.testing.assert_close(got[0], _reference(q, k_blocks, v_blocks, tables, mask)[0])


def test_bad_shapes_and_dtypes_are_refused() -> None:
    q, k_blocks, v_blocks, tables, mask = _case([4], 9, 3, 64, torch.float32)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        paged_decode.attend(q[..., :60], k_blocks[..., :60], v_blocks[..., :60], tables, mask)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        paged_decode.attend(q[:, :8], k_blocks, v_blocks, tables, mask)
    with pytest.raises(RuntimeError, match="mask must be"):
        paged_decode.attend(q, k_blocks, v_blocks, tables, mask[..., 1:])
    with pytest.raises(RuntimeError, match="tables must be int64"):
        paged_decode.attend(q, k_blocks, v_blocks, tables.int(), mask)
    with pytest.raises(RuntimeError, match="q must be"):
        paged_decode.attend(q.half(), k_blocks, v_blocks, tables, mask)


def test_it_serves_only_what_it_reads() -> None:
    cache = torch.zeros(2, 16, 3, 64, dtype=torch.bfloat16)
    assert paged_decode.serves(torch.zeros(1, 9, 64), cache)
    assert not paged_decode.serves(torch.zeros(1, 9, 64, dtype=torch.float16), cache)
    assert not paged_decode.serves(torch.zeros(1, 8, 64), cache)  # 8 heads over 3
    assert not paged_decode.serves(torch.zeros(1, 27, 64), cache)  # 9 to one
    assert not paged_decode.serves(torch.zeros(1, 9, 64), cache.half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunks_attend_as_rows_of_the_decodes_call(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a mixed step, the tokens of every prefill chunk (a new message on a cached prefix,
    a first short prompt, a long chunk) join the decodes' kernel call, so each token attends
    with one order of reduction whatever the step holds; every token gets what attending its
    chunk alone with SDPA gives (where the kernel does not run, chunks attend alone)."""
    heads, kv_heads, dim = 9, 3, 64
    cache = KVCache.allocate(1, NUM_BLOCKS, BLOCK_SIZE, kv_heads, dim, dtype, torch.device("cpu"))
    generator = torch.Generator().manual_seed(7)
    cache.k.copy_(torch.randn(cache.k.shape, generator=generator))
    cache.v.copy_(torch.randn(cache.v.shape, generator=generator))
    # (new tokens, context): 2 decodes, a chunk on a cached prefix, a whole short prompt,
    # and a longer chunk
    steps = [(1, 20), (1, 35), (6, 40), (5, 5), (40, 90)]
    order = (torch.randperm(NUM_BLOCKS - 1, generator=generator) + 1).tolist()
    tables, slots = [], []
    for query, context in steps:
        table, order = order[: -(-context // BLOCK_SIZE)], order[-(-context // BLOCK_SIZE) :]
        tables.append(table)
        new = range(context - query, context)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in new]
    layout = BatchLayout(
        query_lens=[q for q, _ in steps],
        context_lens=[c for _, c in steps],
        block_tables=tables,
        slot_mapping=torch.tensor(slots),
    )
    tokens = len(slots)
    q = torch.randn(tokens, heads, dim, generator=generator).to(dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=generator).to(dtype)
    v = torch.randn(tokens, kv_heads, dim, generator=generator).to(dtype)

    backend = TorchBackend(cache)
    backend.plan(layout)
    assert backend._plan.decode_rows == 2 + 6 + 5 + 40 and not backend._plan.prefills
    joined = backend.forward(0, q, k, v)
    with monkeypatch.context() as patched:  # the same rows where the kernel does not serve
        patched.setattr(paged_decode, "serves", lambda *_: False)
        gathered = backend.forward(0, q, k, v)
    monkeypatch.setattr(paged_decode, "available", lambda: False)  # every chunk alone
    backend.plan(layout)
    assert backend._plan.decode_rows == 2 and len(backend._plan.prefills) == 3
    alone = backend.forward(0, q, k, v)
    for ours in (joined, gathered):
        torch.testing.assert_close(ours.float(), alone.float(), atol=_tolerance(dtype), rtol=0)


def _mixed_step(
    chunks: list[tuple[int, int]],
    decodes: list[int],
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One call's rows as the engine lays a step: each prefill chunk (new tokens, cached
    prefix) a run of rows of one sequence, row i seeing its prefix and the chunk up to and
    including its own token (already in the cache), then one row per decode of another
    sequence. The cache outside what some row sees holds NaN."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [prefix + tokens for tokens, prefix in chunks] + decodes
    blocks = sum(-(-length // BLOCK_SIZE) for length in lengths) + 1
    shape = (blocks, BLOCK_SIZE, kv_heads, dim)
    k_blocks = torch.full(shape, float("nan"), dtype=dtype)
    v_blocks = torch.full(shape, float("nan"), dtype=dtype)
    order = (torch.randperm(blocks - 1, generator=generator) + 1).tolist()
    tables, counts = [], []
    for length, rows in zip(lengths, [t for t, _ in chunks] + [1] * len(decodes), strict=False):
        table = order[: -(-length // BLOCK_SIZE)]
        order = order[len(table) :]
        for pos in range(length):
            at = (table[pos // BLOCK_SIZE], pos % BLOCK_SIZE)
            k_blocks[at] = torch.randn(kv_heads, dim, generator=generator).to(dtype)
            v_blocks[at] = torch.randn(kv_heads, dim, generator=generator).to(dtype)
        tables += [table] * rows
        counts += list(range(length - rows + 1, length + 1))
    width = max(len(table) for table in tables)
    tables = torch.tensor([table + [0] * (width - len(table)) for table in tables])
    shown = torch.arange(width * BLOCK_SIZE)[None] < torch.tensor(counts)[:, None]
    mask = torch.zeros(shown.shape).masked_fill_(~shown, float("-inf"))[:, None, None]
    q = (torch.randn(len(counts), heads, dim, generator=generator) * 2).to(dtype)
    return q, k_blocks, v_blocks, tables, mask


def _with_own_token_as_new(
    k_blocks: torch.Tensor, v_blocks: torch.Tensor, tables: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Each row's mask with its last shown slot hidden and the new column shown, and that
    slot's key and value as the row's new_k and new_v."""
    last = (mask[:, 0, 0] == 0).sum(dim=1) - 1
    table = tables[torch.arange(len(last)), last // BLOCK_SIZE]
    new_k = k_blocks[table, last % BLOCK_SIZE]
    new_v = v_blocks[table, last % BLOCK_SIZE]
    moved = torch.nn.functional.pad(mask, (0, 1), value=0.0)
    moved[torch.arange(len(last)), 0, 0, last] = float("-inf")
    return moved, (new_k, new_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (8, 1, 128), (6, 2, 80)]
)
@pytest.mark.parametrize(
    "chunks",
    [[(1, 0)], [(7, 0), (64, 37)], [(300, 0)], [(300, 21), (7, 100)]],
    ids=["one", "small-and-cached", "300", "300-cached-and-small"],
)
def test_every_row_gets_the_bits_it_gets_alone(
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    dim: int,
    chunks: list[tuple[int, int]],
) -> None:
    """Batch invariance: rows of prefill chunks, mixed with decodes of other sequences, give
    bit for bit what each row gives in a call of its own, and what it gives with its own
    token passed as new_k / new_v rather than read from the cache."""
    if len(chunks) > 1 and dim != 64:
        chunks = chunks[:1]  # the other head shapes: one chunk keeps the test quick
    q, k_blocks, v_blocks, tables, mask = _mixed_step(
        chunks, [20, 150, 33], heads, kv_heads, dim, dtype, seed=len(chunks) + dim
    )
    got = paged_decode.attend(q, k_blocks, v_blocks, tables, mask)
    moved, new = _with_own_token_as_new(k_blocks, v_blocks, tables, mask)
    assert not got.isnan().any()
    for row in range(len(q)):
        alone = paged_decode.attend(
            q[row : row + 1], k_blocks, v_blocks, tables[row : row + 1], mask[row : row + 1]
        )
        assert torch.equal(got[row : row + 1], alone), f"row {row}"
    as_new = paged_decode.attend(q, k_blocks, v_blocks, tables, moved, new)
    assert torch.equal(got, as_new)
    expected = _reference(q, k_blocks.nan_to_num(), v_blocks.nan_to_num(), tables, mask)
    torch.testing.assert_close(got.float(), expected, atol=_tolerance(dtype), rtol=0)


def test_rows_of_a_run_keep_their_own_mask_values() -> None:
    """Finite mask values other than 0 are added to each row's scores, and a row whose mask
    hides a slot inside its prefix attends as a row of its own; both give the bits a call of
    their own gives."""
    q, k_blocks, v_blocks, tables, mask = _mixed_step([(40, 9)], [], 9, 3, 64, torch.float32, 5)
    generator = torch.Generator().manual_seed(6)
    shown = mask != float("-inf")
    mask = torch.where(shown, torch.randn(mask.shape, generator=generator), mask)
    mask[17, 0, 0, 3] = float("-inf")
    got = paged_decode.attend(q, k_blocks, v_blocks, tables, mask)
    for row in range(len(q)):
        alone = paged_decode.attend(
            q[row : row + 1], k_blocks, v_blocks, tables[row : row + 1], mask[row : row + 1]
        )
        assert torch.equal(got[row : row + 1], alone), f"row {row}"
    expected = _reference(q, k_blocks.nan_to_num(), v_blocks.nan_to_num(), tables, mask)
    torch.testing.assert_close(got, expected)
