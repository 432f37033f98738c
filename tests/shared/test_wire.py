"""The job and event encodings: every field comes back as it was sent."""

from __future__ import annotations

import json

import pytest

from shared.event_codec import decode_entry, encode_event
from shared.events import Accepted, Ready, TokenLogprob
from shared.sampling import SamplingParams
from shared.wire import (
    Deadlines,
    ParsingOptions,
    PreparedRequest,
    QueuedRequest,
    decode_queued,
    encode_queued,
)


def full_job() -> QueuedRequest:
    """A job with no field left at its default, so a dropped field cannot go unnoticed."""
    sampling = SamplingParams(
        max_tokens=77, min_tokens=3, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, seed=1234,
        stop=["END", "\n\n"], stop_token_ids=[2, 7], ignore_eos=True, logprobs=5, prompt_logprobs=2,
        skip_special_tokens=False,
    )  # fmt: skip
    parsing = ParsingOptions(
        reasoning=("<think>", "</think>"), starts_in_reasoning=True,
        tool_calls=("<tool_call>", "</tool_call>"), single_tool_call=True,
    )  # fmt: skip
    request = PreparedRequest(
        "chatcmpl-wire", "smollm2", list(range(5000)), sampling, parsing, priority=3, created=12.5
    )
    return QueuedRequest(request, Deadlines(100.0, 200.0, 300.0), origin="api-1")


def test_a_job_round_trips_with_every_field() -> None:
    job = full_job()
    decoded = decode_queued(encode_queued(job))
    assert decoded == job
    assert isinstance(decoded.request.parsing.reasoning, tuple)


def test_encoding_leaves_the_request_untouched() -> None:
    """The encoding shares the request's lists rather than copying them: it must not alter them."""
    job = full_job()
    before = (list(job.request.prompt_token_ids), list(job.request.sampling.stop))
    payload = json.loads(encode_queued(job))
    payload["request"]["prompt_token_ids"].append(-1)  # the decoded copy is its own
    assert (job.request.prompt_token_ids, job.request.sampling.stop) == before


def test_another_version_is_refused() -> None:
    payload = json.loads(encode_queued(full_job()))
    payload["v"] = 99
    with pytest.raises(ValueError, match="version 99"):
        decode_queued(json.dumps(payload))


@pytest.mark.parametrize(
    "prompt_logprobs",
    [None, [], [TokenLogprob(5, -0.25, [(5, -0.25), (9, -1.5)]), TokenLogprob(7, -3.0)]],
)
def test_ready_keeps_its_prompt_logprobs_across_the_stream(prompt_logprobs):
    event = Ready("r1", 3, 0, prompt_logprobs)
    decoded = decode_entry("r1", encode_event(event, attempt=1, seq=1)).event
    assert decoded == event


def test_the_pending_deadline_follows_the_request_s_progress() -> None:
    deadlines = Deadlines(queue=10.0, first_token=20.0, total=30.0)
    assert deadlines.pending(started=False, first_token=False) == (10.0, "queue_timeout")
    assert deadlines.pending(started=True, first_token=False) == (20.0, "first_token_timeout")
    assert deadlines.pending(started=True, first_token=True) == (30.0, "total_timeout")
    late_start = Deadlines(queue=25.0, first_token=20.0, total=30.0)
    assert late_start.pending(started=False, first_token=False) == (20.0, "first_token_timeout")
    assert Deadlines().pending(started=False, first_token=False) == (None, "total_timeout")


def test_accepted_crosses_the_stream_as_itself():
    decoded = decode_entry("r1", encode_event(Accepted("r1"), attempt=2, seq=1))
    assert decoded == (2, 1, Accepted("r1"))
