"""Continuous batching: which sequences run this step, and how many tokens each.

Every step spends a token budget. Running sequences go first, in priority
order, decodes ahead of unfinished prefills; each takes as many of its
uncomputed tokens as the budget allows (chunked prefill). Waiting sequences
are admitted only while the budget, the sequence cap and the cache allow.
When a running sequence needs a block and none is free, the lowest-priority
running sequence is preempted: its blocks are released and it waits to be
recomputed from its tokens.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence and yields a token."""
        return self.seq.num_computed_tokens + self.num_tokens == len(self.seq)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]
    newly_admitted: list[Sequence]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []
        self._short_of_blocks = False  # the last step preempted or stopped admitting for blocks

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.release(seq)

    @property
    def kv_bound(self) -> bool:
        """Sequences wait for free blocks: more requests would only wait here too.

        True after a step that preempted a sequence or could not admit one for
        want of blocks, for as long as a sequence still waits (an abort that
        empties the queue ends it without another step). A worker takes no
        more jobs meanwhile.
        """
        return self._short_of_blocks and bool(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [], [])
        budget = self.max_num_batched_tokens
        self.running.sort(key=lambda s: (s.num_uncomputed_tokens > 1, s.sort_key))
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, num_tokens, out):
                continue
            out.scheduled.append(ScheduledSeq(seq, num_tokens))
            budget -= num_tokens
        self._short_of_blocks = bool(out.preempted)
        if not out.preempted:
            budget = self._admit_waiting(budget, out)
        return out

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt lower-priority sequences until ``seq`` fits; False if it was itself."""
        target = seq.num_computed_tokens + num_tokens
        while not self.block_manager.can_grow(seq, target):
            victim = max(
                (s for s in self.running if s.status is SequenceStatus.RUNNING),
                key=lambda s: s.sort_key,
            )
            self._preempt(victim, out)
            if victim is seq:
                return False
        self.block_manager.grow(seq, target)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self.block_manager.release(seq)
        seq.num_computed_tokens = 0
        self.add(seq)
        out.preempted.append(seq)

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.block_manager.admit(seq)
            num_tokens = min(len(seq) - cached, budget)
            if not self.block_manager.can_grow(seq, cached + num_tokens):
                self.block_manager.release(seq)
                self._short_of_blocks = True
                break
            self.block_manager.grow(seq, cached + num_tokens)
            self.waiting.pop(0)
            seq.num_computed_tokens = cached
            if not seq.announced:
                seq.num_cached_tokens = cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_tokens))
            out.newly_admitted.append(seq)
            budget -= num_tokens
        return budget
