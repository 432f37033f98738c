"""Top-k / top-p / min-p filtering and the seeded draw, against plain references."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, candidates, draw
from engine.sequence import Sequence
from shared.sampling import SamplingParams


def reference_survivors(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """The textbook filter: mask with a full sort, in the same order (k, then p, then min-p)."""
    row = row.clone()
    if p.top_k and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row[row < kth] = float("-inf")
    if p.top_p < 1.0:
        probs, order = row.softmax(-1).sort(descending=True)
        row[order[probs.cumsum(0) - probs > p.top_p]] = float("-inf")
    if p.min_p > 0.0:
        probs = row.softmax(-1)
        row[probs < p.min_p * probs.max()] = float("-inf")
    return set(torch.isfinite(row).nonzero().squeeze(1).tolist())


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])  # flat to peaked distributions
@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p"),
    [(0, 0.9, 0.0), (50, 0.8, 0.0), (0, 1.0, 0.05), (40, 0.95, 0.1), (0, 0.5, 0.0), (7, 1.0, 0.0)],
)
def test_candidates_match_a_full_sort(scale: float, top_k: int, top_p: float, min_p: float) -> None:
    generator = torch.Generator().manual_seed(int(scale * 10) + top_k)
    params = SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p)
    for _ in range(5):
        row = torch.randn(5000, generator=generator) * scale
        values, ids = candidates(row, params)
        survivors = set(range(row.numel())) if ids is None else set(ids.tolist())
        assert survivors == reference_survivors(row, params)
        expected = row if ids is None else row[ids]
        torch.testing.assert_close(values, expected)


def test_draw_is_seeded_and_follows_the_distribution() -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2])
    draws = [draw(probs, seed=11, index=i) for i in range(4000)]
    assert draws == [draw(probs, seed=11, index=i) for i in range(4000)]
    assert draws != [draw(probs, seed=12, index=i) for i in range(4000)]
    counts = torch.bincount(torch.tensor(draws), minlength=5).float() / len(draws)
    assert counts[0] == 0 and counts[2] == 0  # never a zero-probability token
    torch.testing.assert_close(counts, probs, atol=0.03, rtol=0)


def test_a_tiny_top_p_keeps_the_lowest_id_of_tied_tokens_as_greedy_does() -> None:
    """A quantized head gives near-identical tokens identical logits: top_p=0.01 must then
    keep the token greedy's argmax takes, whatever order a sort leaves ties in."""
    row = torch.full((50_000,), -5.0)
    row[[28, 284, 40_000]] = 3.0
    _, ids = candidates(row, SamplingParams(temperature=1.0, top_p=0.01))
    assert ids.tolist() == [28] == [int(row.max(-1).indices)]


@pytest.mark.parametrize("penalty", [1e-300, 1e-30, 1e30, 1e300])
def test_an_extreme_repetition_penalty_still_samples_a_seen_or_unseen_token(
    penalty: float,
) -> None:
    """A penalty that overflows the seen tokens' logits leaves a distribution to draw from."""
    logits = torch.linspace(-4.0, 4.0, 64)[None, :].clone()
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=8, repetition_penalty=penalty)
    seq = Sequence("r", list(range(32, 64)), params)  # the positive half is seen
    (token,), _ = Sampler()(logits, [seq])
    assert 0 <= token < 64
    if penalty < 1:  # favoured: one of the seen tokens
        assert token >= 32
