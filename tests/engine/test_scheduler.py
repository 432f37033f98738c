"""Scheduler: budgets, chunked prefill, admission order and preemption, without a model.

``advance`` plays the engine's part after a step: computed tokens move on,
full blocks are committed, a chunk that reaches the end of its sequence
appends one token, and a sequence that reached ``max_tokens`` is removed.
"""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from shared.sampling import SamplingParams

TOKEN = 5  # what every fake step "samples"


def make_seq(name: str, prompt_len: int, max_tokens: int = 4, priority: int = 0) -> Sequence:
    prompt = [hash((name, i)) % 1000 + 100 for i in range(prompt_len)]
    return Sequence(name, prompt, SamplingParams(max_tokens=max_tokens), priority)


def make_scheduler(
    num_blocks: int = 64, block_size: int = 16, max_num_seqs: int = 8, budget: int = 256
) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget)


def advance(scheduler: Scheduler, out: SchedulerOutput) -> list[Sequence]:
    """Apply one step's results as ``LLMEngine._postprocess`` does; returns finished seqs."""
    finished = []
    sampling = [item.seq for item in out.scheduled if item.samples]
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_tokens
        scheduler.block_manager.commit(item.seq)
    for seq in sampling:
        seq.token_ids.append(TOKEN)
        if seq.num_output_tokens >= seq.params.max_tokens:
            seq.status = SequenceStatus.FINISHED
            scheduler.remove(seq)
            finished.append(seq)
    return finished


def step(scheduler: Scheduler) -> tuple[SchedulerOutput, list[Sequence]]:
    out = scheduler.schedule()
    return out, advance(scheduler, out)


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(item.seq.request_id, item.num_tokens) for item in out.scheduled]


def run_to_completion(scheduler: Scheduler, max_steps: int = 500) -> list[str]:
    """Step until idle; the order in which sequences finished."""
    order: list[str] = []
    for _ in range(max_steps):
        if not scheduler.has_work():
            return order
        out, finished = step(scheduler)
        assert sum(item.num_tokens for item in out.scheduled) <= scheduler.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.max_num_seqs
        order += [seq.request_id for seq in finished]
    raise AssertionError("scheduler did not finish its work")


def test_single_sequence_prefill_then_decodes() -> None:
    scheduler = make_scheduler()
    seq = make_seq("a", 10, max_tokens=3)
    scheduler.add(seq)
    out, _ = step(scheduler)
    assert plan(out) == [("a", 10)]
    assert out.newly_admitted == [seq] and seq.status is SequenceStatus.RUNNING
    for _ in range(2):
        out, _ = step(scheduler)
        assert plan(out) == [("a", 1)]
    assert seq.is_finished and not scheduler.has_work()
    assert seq.token_ids[10:] == [TOKEN] * 3
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_long_prompt_is_chunked_under_the_token_budget() -> None:
    scheduler = make_scheduler(budget=16)
    seq = make_seq("long", 40, max_tokens=2)
    scheduler.add(seq)
    chunks = []
    for _ in range(3):
        out = scheduler.schedule()
        chunks.append((plan(out), [item.samples for item in out.scheduled]))
        advance(scheduler, out)
    assert chunks == [([("long", 16)], [False]), ([("long", 16)], [False]), ([("long", 8)], [True])]
    assert seq.num_computed_tokens == 40 and seq.num_output_tokens == 1
    assert len(seq.block_table) == 3
    out, _ = step(scheduler)
    assert plan(out) == [("long", 1)]
    assert seq.is_finished


def test_budget_is_shared_and_never_exceeded() -> None:
    scheduler = make_scheduler(budget=32)
    for name in "abc":
        scheduler.add(make_seq(name, 20, max_tokens=3))
    out, _ = step(scheduler)
    assert plan(out) == [("a", 20), ("b", 12)]  # c waits: no budget left
    assert [s.request_id for s in scheduler.waiting] == ["c"]
    out, _ = step(scheduler)
    assert plan(out) == [("a", 1), ("b", 8), ("c", 20)]
    assert run_to_completion(scheduler) == ["a", "b", "c"]


def test_decodes_go_before_prefills_even_of_higher_priority() -> None:
    scheduler = make_scheduler(budget=16)
    low = make_seq("low", 4, max_tokens=10, priority=5)
    scheduler.add(low)
    step(scheduler)  # low is now decoding
    high = make_seq("high", 40, priority=0)
    scheduler.add(high)
    out, _ = step(scheduler)
    assert plan(out) == [("low", 1), ("high", 15)]
    out, _ = step(scheduler)  # high is running but still prefilling
    assert plan(out) == [("low", 1), ("high", 15)]
    assert not out.preempted


def test_max_num_seqs_caps_the_running_set() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(f"s{i}", 5, max_tokens=1 + i) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    out, finished = step(scheduler)
    assert plan(out) == [("s0", 5), ("s1", 5)]
    assert [s.request_id for s in finished] == ["s0"]  # max_tokens=1
    assert len(scheduler.waiting) == 2
    out, finished = step(scheduler)
    assert plan(out) == [("s1", 1), ("s2", 5)]  # s0's slot went to s2
    assert [s.request_id for s in finished] == ["s1"]
    assert run_to_completion(scheduler) == ["s2", "s3"]


def test_admission_by_priority_then_arrival() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    spec = [("p2", 2), ("p0-first", 0), ("p1", 1), ("p0-second", 0), ("p-1", -1)]
    for name, priority in spec:
        scheduler.add(make_seq(name, 3, max_tokens=1, priority=priority))
    assert run_to_completion(scheduler) == ["p-1", "p0-first", "p0-second", "p1", "p2"]


def test_running_sequences_are_served_in_priority_order_when_budget_is_short() -> None:
    scheduler = make_scheduler(budget=16, max_num_seqs=2)
    late_high = make_seq("late-high", 30, priority=0)
    early_low = make_seq("early-low", 30, priority=1)
    scheduler.add(early_low)
    scheduler.add(late_high)
    out, _ = step(scheduler)
    assert plan(out) == [("late-high", 16)]
    assert [s.request_id for s in scheduler.waiting] == ["early-low"]
    out, _ = step(scheduler)
    assert plan(out) == [("late-high", 14), ("early-low", 2)]


def _two_decoding(
    num_blocks: int, priorities: tuple[int, int], max_num_seqs: int = 8
) -> tuple[Scheduler, Sequence, Sequence]:
    """``first`` then ``second`` (4-token prompts, block size 4) decoding, two blocks each.

    Both have 9 tokens, 8 of them computed: the next step needs a third block each.
    """
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=max_num_seqs)
    first = make_seq("first", 4, max_tokens=12, priority=priorities[0])
    second = make_seq("second", 4, max_tokens=12, priority=priorities[1])
    scheduler.add(first)
    scheduler.add(second)
    for _ in range(5):  # the prompt, then 4 decodes
        out, _ = step(scheduler)
        assert not out.preempted
    assert len(first) == len(second) == 9
    assert first.num_computed_tokens == second.num_computed_tokens == 8
    assert scheduler.block_manager.num_free_blocks == num_blocks - 4
    return scheduler, first, second


def test_preempts_the_latest_arrival_when_blocks_run_out() -> None:
    scheduler, first, second = _two_decoding(num_blocks=4, priorities=(0, 0))
    bm = scheduler.block_manager
    out, _ = step(scheduler)  # first needs a block and none is free
    assert out.preempted == [second]
    assert plan(out) == [("first", 1)]
    assert second.status is SequenceStatus.WAITING and scheduler.waiting == [second]
    assert second not in scheduler.running
    assert second.block_table == [] and second.num_computed_tokens == 0
    assert len(second) == 9  # its tokens are kept for the recompute
    assert len(first.block_table) == 3
    assert bm.num_free_blocks == 4 - 3  # second's two blocks came back, first took one
    assert not out.newly_admitted  # nothing is admitted in a step that preempted

    assert run_to_completion(scheduler) == ["first", "second"]
    assert first.token_ids[4:] == [TOKEN] * 12 and second.token_ids[4:] == [TOKEN] * 12
    assert bm.num_free_blocks == bm.num_blocks


def test_nothing_is_admitted_in_a_step_that_preempted() -> None:
    scheduler, first, second = _two_decoding(num_blocks=4, priorities=(0, 0), max_num_seqs=2)
    urgent = make_seq("urgent", 3, max_tokens=1, priority=-1)
    scheduler.add(urgent)  # waits for a slot: max_num_seqs is 2
    out, _ = step(scheduler)
    assert out.preempted == [second]
    # A slot and a block are free now, but the step that preempted admits nothing.
    assert scheduler.block_manager.num_free_blocks == 1 and len(scheduler.running) == 1
    assert plan(out) == [("first", 1)]
    assert scheduler.waiting == [urgent, second]
    out, _ = step(scheduler)
    assert plan(out) == [("first", 1), ("urgent", 3)]
    assert run_to_completion(scheduler) == ["first", "second"]


def test_the_lowest_sequence_preempts_itself() -> None:
    scheduler, first, second = _two_decoding(num_blocks=5, priorities=(0, 0))
    out, _ = step(scheduler)  # first takes the last free block; second then has none
    assert out.preempted == [second]
    assert plan(out) == [("first", 1)]
    assert second.block_table == [] and scheduler.waiting == [second]
    assert scheduler.block_manager.num_free_blocks == 2
    assert run_to_completion(scheduler) == ["first", "second"]
    assert scheduler.block_manager.num_free_blocks == 5


def test_preempts_lowest_priority_not_latest_arrival() -> None:
    scheduler, first, second = _two_decoding(num_blocks=4, priorities=(1, 0))
    out, _ = step(scheduler)
    assert out.preempted == [first]  # arrived first, but lower priority
    assert plan(out) == [("second", 1)]
    assert first.block_table == [] and scheduler.waiting == [first]
    assert run_to_completion(scheduler) == ["second", "first"]
    assert scheduler.block_manager.num_free_blocks == 4


def test_preempted_sequence_recomputes_all_its_tokens_in_one_chunk() -> None:
    scheduler, first, second = _two_decoding(num_blocks=4, priorities=(0, 0))
    step(scheduler)  # second is preempted with 9 tokens
    while not first.is_finished:
        out, _ = step(scheduler)
        assert second not in [item.seq for item in out.scheduled]
    out = scheduler.schedule()
    assert out.newly_admitted == [second]
    (item,) = out.scheduled
    assert item.seq is second and item.samples
    assert second.num_computed_tokens + item.num_tokens == 9
    advance(scheduler, out)
    assert second.num_output_tokens == 6  # five before preemption, one after


def test_prefix_hit_skips_cached_tokens_at_admission() -> None:
    scheduler = make_scheduler(block_size=4)
    first = make_seq("first", 10, max_tokens=1)
    scheduler.add(first)
    run_to_completion(scheduler)
    second = Sequence("second", first.token_ids[:10] + [1, 2], SamplingParams(max_tokens=1))
    scheduler.add(second)
    out, _ = step(scheduler)
    assert plan(out) == [("second", 4)]  # 8 of 12 tokens were cached
    assert second.num_cached_tokens == 8
    assert second.is_finished


def test_remove_releases_waiting_and_running_sequences() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    running, waiting = make_seq("running", 20), make_seq("waiting", 20)
    scheduler.add(running)
    scheduler.add(waiting)
    step(scheduler)
    assert scheduler.block_manager.num_free_blocks == 64 - 2
    scheduler.remove(running)
    scheduler.remove(waiting)
    assert not scheduler.has_work()
    assert scheduler.block_manager.num_free_blocks == 64


def test_kv_bound_while_a_waiting_sequence_lacks_blocks() -> None:
    """What tells a worker to take no more jobs: only a lack of blocks, not of budget or slots."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=1, budget=8)
    first = make_seq("first", 12, max_tokens=2)
    scheduler.add(first)
    step(scheduler)
    assert not scheduler.kv_bound  # chunked by the budget: waiting for tokens, not blocks

    scheduler.add(make_seq("second", 4))
    step(scheduler)
    assert scheduler.waiting and not scheduler.kv_bound  # waits for a slot (max_num_seqs)

    scheduler.max_num_seqs = 2
    step(scheduler)  # first's decode takes the last free block: second's prompt finds none
    assert scheduler.kv_bound and [seq.request_id for seq in scheduler.waiting] == ["second"]

    assert run_to_completion(scheduler)[-1] == "second"
    assert not scheduler.kv_bound


def test_kv_bound_after_a_preemption_until_nothing_waits() -> None:
    scheduler, _, second = _two_decoding(num_blocks=4, priorities=(0, 0))
    assert not scheduler.kv_bound
    out, _ = step(scheduler)
    assert out.preempted == [second] and scheduler.kv_bound

    scheduler.remove(second)  # aborted: the engine may take no further step
    assert not scheduler.kv_bound
