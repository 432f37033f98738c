"""Turns a scheduled batch into one forward pass.

Tokens of every scheduled sequence are laid end to end with their positions
and cache slots; the attention backend is planned once for the step; logits
are computed only where a sequence samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend, BatchLayout
from engine.model.llama import LlamaForCausalLM
from engine.scheduler import ScheduledSeq


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    layout: BatchLayout
    sampling: list[ScheduledSeq]  # the scheduled sequences that produce a token, in logits order


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        attention: AttentionBackend,
        block_size: int,
        device: torch.device,
    ):
        self.model = model
        self.attention = attention
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Logits ``[sampling sequences, vocab]`` and the sequences they belong to."""
        inputs = self.prepare(scheduled)
        self.attention.plan(inputs.layout)
        logits = self.model(
            inputs.input_ids, inputs.positions, self.attention, inputs.logits_indices
        )
        return logits, inputs.sampling

    def prepare(self, scheduled: list[ScheduledSeq]) -> StepInputs:
        ordered = sorted(scheduled, key=lambda s: s.num_tokens != 1)  # decodes first
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        sampling: list[ScheduledSeq] = []
        bs = self.block_size
        for item in ordered:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if item.samples:
                logits_indices.append(len(input_ids) - 1)
                sampling.append(item)
        layout = BatchLayout(
            query_lens=[s.num_tokens for s in ordered],
            context_lens=[s.seq.num_computed_tokens + s.num_tokens for s in ordered],
            block_tables=[s.seq.block_table for s in ordered],
            slot_mapping=self._tensor(slots),
        )
        return StepInputs(
            self._tensor(input_ids),
            self._tensor(positions),
            self._tensor(logits_indices),
            layout,
            sampling,
        )

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
