"""Grammar matchers for constrained sequences, and the token masks they allow.

A constrained sequence owns one llguidance matcher, advanced on every token
it samples. Each step the masks of the constrained rows are filled on a
helper thread while the forward pass runs (llguidance releases the GIL), and
applied to those rows' logits before sampling; other rows are untouched.
Grammars are compiled once per distinct grammar text and copied per sequence.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import llguidance.numpy  # not llguidance.torch: it imports torch.compile's stack (~100 MB)
import numpy as np
import torch

from engine.sequence import Sequence
from shared.constraints import ConstraintError, check, grammar_of, lltokenizer
from shared.sampling import StructuredOutputs
from shared.tokenizer_loader import LoadedTokenizer

COMPILED_GRAMMARS = 256  # distinct grammars kept compiled, least recently used first out


@dataclass(slots=True)
class GrammarMask:
    """Tokens the constrained rows may not take: ``ruled_out[i]`` is for logits row ``rows[i]``."""

    rows: list[int]
    ruled_out: torch.Tensor  # bool [len(rows), vocab]

    def apply(self, logits: torch.Tensor) -> None:
        """Rule out the disallowed tokens of the constrained rows, in place, row by row.

        In place on each row's view: indexing all rows at once would copy
        them out and back, which costs more than the fill itself.
        """
        ruled_out = self.ruled_out.to(logits.device, non_blocking=True)
        for index, row in enumerate(self.rows):
            logits[row].masked_fill_(ruled_out[index], float("-inf"))


class PendingMasks:
    """Masks being filled for some sequences while the model runs."""

    def __init__(self, seqs: list[Sequence], bitmask: np.ndarray, filled: Future[None]):
        self.seqs = seqs
        self._bitmask = bitmask
        self._filled = filled

    def result(self, row_of: dict[int, int], vocab_size: int) -> GrammarMask:
        """Wait for the masks; ``row_of`` maps ``id(seq)`` to its logits row."""
        self._filled.result()
        bits = np.unpackbits(self._bitmask.view(np.uint8), axis=1, bitorder="little")
        ruled_out = torch.from_numpy(bits[:, :vocab_size] == 0)
        return GrammarMask([row_of[id(seq)] for seq in self.seqs], ruled_out)


class Constraints:
    """One engine's grammar compiler, matcher factory and mask filler.

    The llguidance tokenizer is built on first use (a fraction of a second),
    so an engine that never sees a constraint never pays for it.
    """

    def __init__(self, tokenizer: LoadedTokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None
        self._thread: ThreadPoolExecutor | None = None
        self.compiled = 0  # grammars compiled (cache misses), for tests and benchmarks

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        return lltokenizer(self._tokenizer, self.vocab_size)

    def matcher(self, spec: StructuredOutputs, generated: list[int]) -> llguidance.LLMatcher:
        """A fresh matcher for ``spec`` that has already consumed ``generated``.

        Raises ``ValueError`` for a grammar llguidance refuses, or for
        generated tokens it does not accept (a resumed request whose grammar
        changed).
        """
        matcher = self._template(grammar_of(spec)).deep_copy()
        if generated and not matcher.consume_tokens(generated):
            raise ValueError(
                f"the generated tokens do not match the grammar: {matcher.get_error()}"
            )
        return matcher

    def start_masks(self, seqs: list[Sequence]) -> PendingMasks | None:
        """Begin filling the next-token masks of the constrained ``seqs``.

        A sequence whose matcher was freed (it was preempted) gets a new one
        that replays its output so far.
        """
        constrained = [seq for seq in seqs if seq.params.structured_outputs is not None]
        if not constrained:
            return None
        for seq in constrained:
            if seq.matcher is None:
                seq.matcher = self.matcher(seq.params.structured_outputs, seq.output_token_ids)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
            self._executor = llguidance.LLExecutor()
        bitmask = llguidance.numpy.allocate_token_bitmask(len(constrained), self.vocab_size)
        pairs = [(seq.matcher, index) for index, seq in enumerate(constrained)]
        filled = self._thread.submit(
            llguidance.numpy.fill_next_token_bitmask_par, self._executor, pairs, bitmask
        )
        return PendingMasks(constrained, bitmask, filled)

    def _template(self, grammar: str) -> llguidance.LLMatcher:
        key = hashlib.sha256(grammar.encode()).hexdigest()
        template = self._compiled.get(key)
        if template is not None:
            self._compiled.move_to_end(key)
            return template
        try:
            check(grammar, "structured_outputs", self.lltokenizer)
        except ConstraintError as exc:
            raise ValueError(str(exc)) from None
        template = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"structured_outputs: {template.get_error()}")
        self.compiled += 1
        self._compiled[key] = template
        if len(self._compiled) > COMPILED_GRAMMARS:
            self._compiled.popitem(last=False)
        return template
