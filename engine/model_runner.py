"""Turns a scheduled batch into one forward pass.

Tokens of every scheduled sequence are laid end to end with their positions
and cache slots; the attention backend is planned once for the step; logits
are computed only where a sequence samples, and at the prompt positions of a
sequence that asked for prompt logprobs (in slices, so a long prompt never
holds a whole chunk's logits at once). A chunk that covers image tokens
places the image's features there, running the vision encoder the first time
the sequence needs them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend, BatchLayout
from engine.compiled import CompiledDecode
from engine.model.idefics3 import Idefics3ForConditionalGeneration
from engine.model.llama import LlamaForCausalLM, Placed
from engine.sampler import prompt_logprobs
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from shared.events import TokenLogprob

log = logging.getLogger(__name__)

PROMPT_LOGITS_SLICE = 256  # prompt positions whose logits exist at once

CausalLM = LlamaForCausalLM | Idefics3ForConditionalGeneration


@dataclass(slots=True)
class PromptRows:
    """Positions of one sequence's prompt whose next-token logprobs this step computes."""

    seq: Sequence
    first: int  # the first position; position p scores prompt token p + 1
    count: int


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor  # hidden rows read out: sampling rows first, then prompt rows
    layout: BatchLayout
    sampling: list[ScheduledSeq]  # the scheduled sequences that produce a token, in row order
    prompt: list[PromptRows]  # in row order, after the sampling rows
    placed: Placed | None = None  # image features and the rows they replace


@dataclass(slots=True)
class StepOutput:
    logits: torch.Tensor  # [len(sampling), vocab]
    sampling: list[ScheduledSeq]
    prompt_logprobs: list[tuple[Sequence, list[TokenLogprob]]]


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        attention: AttentionBackend,
        block_size: int,
        device: torch.device,
        compiled_batch: int = 0,
    ):
        """``compiled_batch``: run decode steps of up to that many sequences through
        ``CompiledDecode`` (a CPU text model); 0 runs every step eagerly."""
        self.model = model
        self.attention = attention
        self.block_size = block_size
        self.device = device
        self.compiled = (
            CompiledDecode(model, attention.kv_cache, compiled_batch) if compiled_batch else None
        )

    def warm_up(self, background: bool = False) -> None:
        """Load the decode graphs, compiling them now or, with ``background``, while steps
        run eagerly; on failure (no C++ compiler, say) decode eagerly."""
        if self.compiled is None:
            return
        try:
            self.compiled.warm_up(background)
        except Exception:
            log.warning("decode steps run eagerly: compiling them failed", exc_info=True)
            self.compiled = None

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> StepOutput:
        """Logits of the sampling sequences, and the prompt logprobs this step computed."""
        inputs = self.prepare(scheduled)
        if self._compiled_takes(inputs):
            logits = self.compiled(inputs.input_ids, inputs.positions, inputs.layout)
            return StepOutput(logits, inputs.sampling, [])
        self.attention.plan(inputs.layout)
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.attention, inputs.rows, inputs.placed
        )
        sampled = len(inputs.sampling)
        logits = self.model.compute_logits(hidden[:sampled])
        return StepOutput(logits, inputs.sampling, self._prompt_logprobs(inputs, hidden[sampled:]))

    def _compiled_takes(self, inputs: StepInputs) -> bool:
        """Whether the compiled graph runs this step: a decode batch whose every row samples
        and none scores its prompt.

        The graph returns logits for every row, in row order, and no hidden states;
        a one-token prompt chunk that does not end its prompt samples nothing.
        """
        return (
            self.compiled is not None
            and self.compiled.takes(inputs.layout)
            and len(inputs.sampling) == len(inputs.input_ids)
            and not inputs.prompt
        )

    def prepare(self, scheduled: list[ScheduledSeq]) -> StepInputs:
        ordered = sorted(scheduled, key=lambda s: s.num_tokens)  # decodes, then short chunks
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sampling_rows: list[int] = []
        sampling: list[ScheduledSeq] = []
        prompt_rows: list[int] = []
        prompt: list[PromptRows] = []
        placed_rows: list[int] = []
        placed: list[torch.Tensor] = []
        bs = self.block_size
        for item in ordered:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            offset = len(input_ids) - start  # the row of position p is p + offset
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if item.samples:
                sampling_rows.append(len(input_ids) - 1)
                sampling.append(item)
            if seq.vision is not None:
                first, last = seq.vision.between(start, end)
                if first < last:
                    placed_rows += [p + offset for p in seq.vision.positions[first:last]]
                    placed.append(self._features(seq)[first:last])
            if seq.needs_prompt_logprobs:
                assert seq.prompt_logprobs is not None
                first = max(start, len(seq.prompt_logprobs))
                last = min(end, seq.num_prompt_tokens - 1)
                if first < last:
                    prompt_rows.extend(range(first + offset, last + offset))
                    prompt.append(PromptRows(seq, first, last - first))
        layout = BatchLayout(
            query_lens=[s.num_tokens for s in ordered],
            context_lens=[s.seq.num_computed_tokens + s.num_tokens for s in ordered],
            block_tables=[s.seq.block_table for s in ordered],
            slot_mapping=self._tensor(slots),
        )
        return StepInputs(
            self._tensor(input_ids),
            self._tensor(positions),
            self._tensor(sampling_rows + prompt_rows),
            layout,
            sampling,
            prompt,
            (self._tensor(placed_rows), torch.cat(placed)) if placed else None,
        )

    def _features(self, seq: Sequence) -> torch.Tensor:
        """The sequence's image features, encoded on first use and kept while it runs."""
        vision = seq.vision
        if vision.features is None:
            assert isinstance(self.model, Idefics3ForConditionalGeneration)
            vision.features = self.model.encode_images(vision.tiles().to(self.device))
            vision.pictures = []
        return vision.features

    def _prompt_logprobs(
        self, inputs: StepInputs, hidden: torch.Tensor
    ) -> list[tuple[Sequence, list[TokenLogprob]]]:
        """Each prompt span's logprobs of the tokens that follow its positions."""
        results = []
        row = 0
        for span in inputs.prompt:
            seq, top = span.seq, span.seq.params.prompt_logprobs or 0
            entries: list[TokenLogprob] = []
            for at in range(0, span.count, PROMPT_LOGITS_SLICE):
                count = min(PROMPT_LOGITS_SLICE, span.count - at)
                logits = self.model.compute_logits(hidden[row + at : row + at + count])
                first = span.first + at + 1
                entries += prompt_logprobs(logits, seq.token_ids[first : first + count], top)
            results.append((seq, entries))
            row += span.count
        return results

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
