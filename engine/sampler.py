"""Chooses each sequence's next token from its logits.

Every random draw uses a generator seeded from the request's seed and the
index of the token being drawn, so a seeded request samples the same tokens
whatever else is in the batch, and a request resumed elsewhere continues the
same draws. Greedy rows take the argmax and skip all of that.
"""

from __future__ import annotations

import torch

from engine.sequence import Sequence
from shared.events import TokenLogprob

_MIX = 0x9E3779B97F4A7C15  # spreads (seed, index) pairs over the seed space


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Repetition (prompt and output), frequency and presence (output) penalties, in place."""
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), device=logits.device)
            values = logits[row, seen]
            logits[row, seen] = torch.where(
                values > 0, values / p.repetition_penalty, values * p.repetition_penalty
            )
        if (p.frequency_penalty or p.presence_penalty) and seq.num_output_tokens:
            output = torch.tensor(seq.output_token_ids, device=logits.device)
            counts = torch.bincount(output, minlength=logits.shape[1]).to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def ban_stops_before_min_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    for row, seq in enumerate(seqs):
        if seq.num_output_tokens < seq.params.min_tokens and seq.stop_token_ids:
            logits[row, list(seq.stop_token_ids)] = float("-inf")


def filter_logits(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask everything outside top-k, the top-p nucleus and the min-p floor."""
    if top_k and top_k < row.numel():
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = sorted_logits.softmax(-1)
        outside = probs.cumsum(-1) - probs > top_p  # keep the token that crosses top_p
        row = row.scatter(0, order[outside], float("-inf"))
    if min_p > 0.0:
        probs = row.softmax(-1)
        row = row.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return row


def draw(probs: torch.Tensor, seed: int, index: int) -> int:
    """Sample one token: argmax of p / Exp(1) noise is a draw from p."""
    generator = torch.Generator(device=probs.device)
    generator.manual_seed((seed * _MIX + index) & 0x7FFF_FFFF_FFFF_FFFF)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def top_logprobs(logprobs: torch.Tensor, token: int, n: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if n:
        values, ids = torch.topk(logprobs, n)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(logprobs[token]), top)


class Sampler:
    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        raw = logits
        if any(
            s.params.repetition_penalty != 1.0
            or s.params.frequency_penalty
            or s.params.presence_penalty
            or s.params.min_tokens
            for s in seqs
        ):
            logits = logits.clone()
            apply_penalties(logits, seqs)
            ban_stops_before_min_tokens(logits, seqs)
        tokens = logits.argmax(-1).tolist()
        for row, seq in enumerate(seqs):
            p = seq.params
            if not p.greedy:
                scaled = filter_logits(logits[row] / p.temperature, p.top_k, p.top_p, p.min_p)
                tokens[row] = draw(scaled.softmax(-1), seq.seed, seq.num_output_tokens)
        return tokens, self._logprobs(raw, seqs, tokens)

    def _logprobs(
        self, raw: torch.Tensor, seqs: list[Sequence], tokens: list[int]
    ) -> list[TokenLogprob | None]:
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        result: list[TokenLogprob | None] = [None] * len(seqs)
        if not rows:
            return result
        logprobs = raw[rows].log_softmax(-1)
        for i, row in enumerate(rows):
            result[row] = top_logprobs(logprobs[i], tokens[row], seqs[row].params.logprobs or 0)
        return result
