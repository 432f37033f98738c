"""Files, OpenAI's Batch API and Anthropic's Message Batches through the official SDKs.

One real server runs with two API keys, small file limits and a short
completion window, so ownership, the 413s and expiry are shown on the same
server that runs the batches. Greedy decoding makes every batch line's answer
comparable with the same request made directly.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from openai import OpenAI

from tests.servers import cpu_seconds, running_server, server_pid

pytestmark = pytest.mark.slow

ALICE, BOB = "sk-alice-batches", "sk-bob-batches"
MAX_FILE_BYTES = 16_384
MAX_PER_KEY = 65_536
WINDOW_S = 20  # a batch's completion window: what has not ended by then expires
CHAT = "/v1/chat/completions"
TOPICS = ["sea", "moon", "sun", "rain", "snow", "wind", "sand", "stars", "trees", "rivers", "hills"]


# Keys with limits, each used by one test: a minute's tokens, a minute's requests.
LIMITED = {
    "sk-carol-batches": "tokens_per_minute = 400",
    "sk-dave-batches": "requests_per_minute = 2",
    "sk-erin-batches": "requests_per_minute = 3",
    "sk-frank-batches": "",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("batches")
    keys = directory / "keys.toml"
    keys.write_text(
        "".join(
            f'[keys.{key.split("-")[1]}]\nsha256 = "{hashlib.sha256(key.encode()).hexdigest()}"'
            f"\n{limits}\n\n"
            for key, limits in LIMITED.items()
        )
    )
    args = [
        "--max-model-len", "1024", "--max-num-seqs", "4", "--batch-concurrency", "4",
        "--api-key", ALICE, "--api-key", BOB, "--api-keys", str(keys),
        "--max-file-bytes", str(MAX_FILE_BYTES), "--max-file-bytes-per-key", str(MAX_PER_KEY),
        "--batch-completion-window", str(WINDOW_S),
    ]  # fmt: skip
    with running_server(args, directory) as base_url:
        yield base_url


def client_of(server: str, key: str) -> OpenAI:
    return OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def alice(server: str) -> OpenAI:
    return OpenAI(base_url=f"{server}/v1", api_key=ALICE, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def bob(server: str) -> OpenAI:
    return OpenAI(base_url=f"{server}/v1", api_key=BOB, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key=ALICE, max_retries=0, timeout=120)


def chat_body(topic: str, tokens: int = 6) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"Write one sentence about the {topic}."}]
    return {"model": "default", "messages": messages, "max_tokens": tokens, "temperature": 0}


def responses_body(topic: str) -> dict[str, Any]:
    prompt = f"Name one thing about the {topic}."
    return {"model": "default", "input": prompt, "max_output_tokens": 6, "temperature": 0}


def upload(client: OpenAI, lines: list[dict[str, Any]] | bytes) -> str:
    content = lines if isinstance(lines, bytes) else "".join(json.dumps(x) + "\n" for x in lines)
    data = content if isinstance(content, bytes) else content.encode()
    return client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch").id


def line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def settled(client: OpenAI, batch_id: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.2)
    pytest.fail(f"batch {batch_id} never ended")


def create_batch(client: OpenAI, lines: list[dict[str, Any]] | bytes, url: str = CHAT, **options):
    """A batch of ``lines`` uploaded as its input file, for ``url``."""
    return client.batches.create(
        input_file_id=upload(client, lines), endpoint=url, completion_window="24h", **options
    )


def wait_completed(client: OpenAI, batch_id: str, count: int, timeout: float = 120) -> None:
    """Until ``count`` of the batch's requests have completed."""
    deadline = time.monotonic() + timeout
    while client.batches.retrieve(batch_id).request_counts.completed < count:
        assert time.monotonic() < deadline, f"batch {batch_id}: {count} never completed"
        time.sleep(0.1)


def jsonl(client: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def answer(body: dict[str, Any]) -> Any:
    """What greedy decoding decides: the text, how it ended, how many tokens."""
    if body.get("object") == "response":
        return (
            body["output"][-1]["content"][0]["text"],
            body["status"],
            body["usage"]["output_tokens"],
        )
    choice = body["choices"][0]
    return choice["message"]["content"], choice["finish_reason"], body["usage"]["completion_tokens"]


@pytest.mark.parametrize(
    ("url", "make", "count"),
    [("/v1/chat/completions", chat_body, 11), ("/v1/responses", responses_body, 10)],
)
def test_every_line_is_answered_once_as_the_direct_request_is(
    alice: OpenAI, url: str, make, count: int
):
    topics = TOPICS[:count]
    lines = [line(f"req-{topic}", url, make(topic)) for topic in topics]
    lines.insert(3, line("broken", url, {**make("sea"), "temperature": 7}))
    batch = alice.batches.create(
        input_file_id=upload(alice, lines),
        endpoint=url,
        completion_window="24h",
        metadata={"suite": "e2e"},
    )
    assert batch.status == "in_progress" and batch.request_counts.total == count + 1
    done = settled(alice, batch.id)
    assert done.status == "completed" and done.metadata == {"suite": "e2e"}
    assert done.request_counts.completed == count and done.request_counts.failed == 1
    output = jsonl(alice, done.output_file_id)
    assert sorted(x["custom_id"] for x in output) == sorted(f"req-{t}" for t in topics)
    (error,) = jsonl(alice, done.error_file_id)
    assert error["custom_id"] == "broken" and error["response"]["status_code"] == 400
    assert "temperature" in json.dumps(error["response"]["body"])
    path = url.removeprefix("/v1")  # the client's base URL ends in /v1
    direct = {f"req-{t}": alice.post(path, cast_to=object, body=make(t)) for t in topics}
    for item in output:
        assert item["response"]["status_code"] == 200 and item["error"] is None
        assert answer(item["response"]["body"]) == answer(direct[item["custom_id"]])


def test_cancelling_mid_way_leaves_a_cancelled_batch_with_true_counts(alice: OpenAI):
    topics = [f"{topic} number {n}" for n in range(3) for topic in TOPICS[:8]]
    lines = [line(f"c{i}", "/v1/chat/completions", chat_body(t, 24)) for i, t in enumerate(topics)]
    batch = create_batch(alice, lines)
    wait_completed(alice, batch.id, 2, timeout=120)
    assert alice.batches.cancel(batch.id).status == "cancelling"
    done = settled(alice, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    output, errors = jsonl(alice, done.output_file_id), jsonl(alice, done.error_file_id)
    assert done.request_counts.completed == len(output) >= 2
    assert done.request_counts.failed == len(errors) == 0
    assert len(output) < len(lines)  # the rest never ran or was cut short


def test_output_files_expire_when_asked_and_unknown_fields_are_refused(alice: OpenAI):
    lines = [line("only", "/v1/chat/completions", chat_body("sea", 2))]
    batch = alice.batches.create(
        input_file_id=upload(alice, lines),
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    done = settled(alice, batch.id)
    output = alice.files.retrieve(done.output_file_id)
    assert output.purpose == "batch_output" and output.expires_at == output.created_at + 7200
    with pytest.raises(openai.BadRequestError) as caught:
        alice.batches.create(
            input_file_id=batch.input_file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_body={"priority": 1},
        )
    assert caught.value.body["param"] == "priority"


def test_a_malformed_file_fails_validation_naming_its_lines(alice: OpenAI):
    good = line("ok", "/v1/chat/completions", chat_body("sea"))
    content = (
        json.dumps(good)
        + "\nnot json\n"
        + json.dumps({**good, "custom_id": "other", "url": "/v1/responses"})
        + "\n"
    ).encode()
    batch = alice.batches.create(
        input_file_id=upload(alice, content),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    assert batch.status == "failed" and batch.errors is not None
    assert [(e.line, e.code) for e in batch.errors.data] == [
        (2, "invalid_json"),
        (3, "mismatched_url"),
    ]


def test_files_are_listed_read_deleted_and_bounded(alice: OpenAI, bob: OpenAI):
    file_id = upload(alice, [line("x", "/v1/chat/completions", chat_body("sea"))])
    later = upload(alice, [line("y", "/v1/chat/completions", chat_body("moon"))])
    newest_first = [f.id for f in alice.files.list(purpose="batch").data]
    assert newest_first.index(later) < newest_first.index(file_id)
    oldest_first = [f.id for f in alice.files.list(purpose="batch", order="asc").data]
    assert oldest_first == newest_first[::-1]
    page = alice.files.list(purpose="batch", order="asc", after=file_id, limit=1)
    assert [f.id for f in page.data] == [later]
    alice.files.delete(later)
    assert json.loads(alice.files.content(file_id).text)["custom_id"] == "x"
    for call in (
        lambda: bob.files.retrieve(file_id),
        lambda: bob.files.content(file_id),
        lambda: bob.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert alice.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(file_id)
    with pytest.raises(openai.APIStatusError) as caught:
        upload(alice, b"x" * (MAX_FILE_BYTES + 1))
    assert caught.value.status_code == 413 and "--max-file-bytes" in caught.value.message
    kept = [upload(bob, b"y" * MAX_FILE_BYTES) for _ in range(MAX_PER_KEY // MAX_FILE_BYTES)]
    with pytest.raises(openai.APIStatusError) as caught:
        upload(bob, b"z")
    assert caught.value.status_code == 413 and "per-key" in caught.value.message
    for file_id in kept:
        bob.files.delete(file_id)


def test_a_batch_belongs_to_the_key_that_created_it(alice: OpenAI, bob: OpenAI):
    lines = [line("only", "/v1/chat/completions", chat_body("sea", 2))]
    batch = create_batch(alice, lines)
    with pytest.raises(openai.NotFoundError):
        bob.batches.retrieve(batch.id)
    assert batch.id not in [b.id for b in bob.batches.list().data]
    assert batch.id in [b.id for b in alice.batches.list().data]
    settled(alice, batch.id)


def test_a_line_larger_than_the_key_s_tokens_per_minute_fails_at_once(server: str):
    """No wait lets it in: its line errs with the 429, the rest of the batch runs."""
    carol = client_of(server, "sk-carol-batches")
    lines = [
        line("huge", "/v1/chat/completions", chat_body("sea", 600)),
        line("small", "/v1/chat/completions", chat_body("moon", 4)),
    ]
    batch = create_batch(carol, lines)
    done = settled(carol, batch.id, timeout=60)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    (error,) = jsonl(carol, done.error_file_id)
    assert error["custom_id"] == "huge" and error["response"]["status_code"] == 429
    assert "lower max_tokens" in json.dumps(error["response"]["body"])


def test_a_line_waiting_for_its_key_s_requests_costs_the_server_nothing(server: str):
    """A line the key's minute of requests holds back waits for the bucket, not in a loop."""
    dave = client_of(server, "sk-dave-batches")
    lines = [line(f"d{n}", "/v1/chat/completions", chat_body(TOPICS[n], 2)) for n in range(3)]
    batch = create_batch(dave, lines)
    wait_completed(dave, batch.id, 2, timeout=60)
    pid = server_pid(server)
    assert pid is not None
    before, started = cpu_seconds(pid), time.monotonic()
    time.sleep(3)  # the third line waits about 30 s for the bucket
    busy = (cpu_seconds(pid) - before) / (time.monotonic() - started)
    assert busy < 0.15, f"the server used {busy:.0%} of a core while the line waited"
    assert dave.batches.retrieve(batch.id).request_counts.completed == 2
    dave.batches.cancel(batch.id)
    done = settled(dave, batch.id, timeout=30)
    assert done.status == "cancelled" and len(jsonl(dave, done.output_file_id)) == 2


def test_a_refused_batch_of_jobs_spends_none_of_the_key_s_requests(server: str):
    job = {"endpoint": "/v1/chat/completions", "body": chat_body("sea", 2)}
    headers = {"Authorization": "Bearer sk-erin-batches"}
    with httpx.Client(base_url=server, headers=headers, timeout=60) as erin:
        refused = erin.post("/v1/jobs/batch", json=[job] * 4)  # one past three a minute
        assert refused.status_code == 429, refused.text
        assert erin.get("/v1/jobs").json()["data"] == []  # nothing queued
        accepted = erin.post("/v1/jobs/batch", json=[job] * 3)  # and nothing spent
        assert accepted.status_code == 202, accepted.text


def test_responses_lines_continue_the_responses_they_name(alice: OpenAI, bob: OpenAI):
    first = alice.responses.create(**responses_body("sea"))
    others = bob.responses.create(**responses_body("moon"))
    follow_up = {**responses_body("sun"), "previous_response_id": first.id}
    lines = [
        line("continued", "/v1/responses", follow_up),
        line("unknown", "/v1/responses", {**follow_up, "previous_response_id": "resp_" + "0" * 24}),
        line("not-mine", "/v1/responses", {**follow_up, "previous_response_id": others.id}),
    ]
    done = settled(alice, create_batch(alice, lines, "/v1/responses").id)
    (output,) = jsonl(alice, done.output_file_id)
    direct = alice.responses.create(**follow_up)
    assert output["custom_id"] == "continued"
    body = output["response"]["body"]
    assert answer(body) == answer(direct.model_dump())
    assert body["usage"]["input_tokens"] == direct.usage.input_tokens  # the history is in it
    errors = {e["custom_id"]: e["response"] for e in jsonl(alice, done.error_file_id)}
    assert {name: e["status_code"] for name, e in errors.items()} == {
        "unknown": 404,
        "not-mine": 404,
    }


def test_a_batch_file_of_json_lines_with_raw_line_separators_in_strings_is_read(alice: OpenAI):
    """JSON strings may hold U+2028, U+2029 and U+0085 raw: they do not end a line."""
    topics = ["sea\u2028moon", "sun\u2029rain", "snow\u0085wind"]
    lines = [line(f"s{n}", "/v1/chat/completions", chat_body(t, 2)) for n, t in enumerate(topics)]
    content = "\ufeff" + "\r\n".join(json.dumps(x, ensure_ascii=False) for x in lines) + "\r\n"
    batch = create_batch(alice, content.encode())
    assert batch.status == "in_progress", batch.errors
    done = settled(alice, batch.id)
    assert sorted(x["custom_id"] for x in jsonl(alice, done.output_file_id)) == ["s0", "s1", "s2"]


def test_batch_outputs_are_not_charged_to_the_key_s_quota(server: str):
    frank = client_of(server, "sk-frank-batches")
    lines = [line(f"o{n}", "/v1/chat/completions", chat_body(TOPICS[n], 24)) for n in range(4)]
    input_file = upload(frank, lines)
    batch = frank.batches.create(
        input_file_id=input_file, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = settled(frank, batch.id)
    assert frank.files.retrieve(done.output_file_id).bytes > 1000
    room = MAX_PER_KEY - frank.files.retrieve(input_file).bytes
    for size in [MAX_FILE_BYTES] * (room // MAX_FILE_BYTES) + [room % MAX_FILE_BYTES]:
        upload(frank, b"f" * size)  # up to the quota exactly, the output beside it
    with pytest.raises(openai.APIStatusError) as caught:
        upload(frank, b"f")
    assert caught.value.status_code == 413


def test_a_job_list_cursor_of_another_key_lists_nothing(server: str):
    """An id of another key's job is no cursor: the answer says nothing of that job."""
    job = {"endpoint": "/v1/chat/completions", "body": chat_body("sea", 1)}
    ids = {}
    for key in (ALICE, BOB):
        headers = {"Authorization": f"Bearer {key}"}
        ids[key] = httpx.post(f"{server}/v1/jobs", json=job, headers=headers).json()["id"]
    alice = {"Authorization": f"Bearer {ALICE}"}
    own = httpx.get(f"{server}/v1/jobs", params={"limit": 100}, headers=alice).json()["data"]
    assert ids[ALICE] in [item["id"] for item in own] and ids[BOB] not in str(own)
    page = httpx.get(f"{server}/v1/jobs", params={"after": ids[BOB]}, headers=alice).json()
    assert (page["data"], page["has_more"]) == ([], False)


# --- Anthropic's Message Batches -------------------------------------------------------------


def messages_params(topic: str, tokens: int = 6) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"Write one sentence about the {topic}."}]
    return {"model": "default", "max_tokens": tokens, "messages": messages, "temperature": 0}


def ended(client: anthropic.Anthropic, batch_id: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended":
            return batch
        time.sleep(0.2)
    pytest.fail(f"message batch {batch_id} never ended")


def test_message_batch_results_are_the_direct_answers(claude: anthropic.Anthropic, alice: OpenAI):
    topics = TOPICS[:10]
    requests = [{"custom_id": f"m-{t}", "params": messages_params(t)} for t in topics]
    batch = claude.messages.batches.create(requests=requests)
    assert batch.processing_status == "in_progress" and batch.request_counts.processing == 10
    done = ended(claude, batch.id)
    assert done.request_counts.succeeded == 10 and done.ended_at is not None
    results = {r.custom_id: r.result for r in claude.messages.batches.results(batch.id)}
    assert sorted(results) == sorted(f"m-{t}" for t in topics)
    for topic in topics:
        params = messages_params(topic)
        greedy = {"temperature": params.pop("temperature")}  # the SDK has no such argument
        direct = claude.messages.create(**params, extra_body=greedy)
        result = results[f"m-{topic}"]
        assert result.type == "succeeded"
        assert result.message.content[0].text == direct.content[0].text
        assert result.message.stop_reason == direct.stop_reason
    assert batch.id in [b.id for b in claude.messages.batches.list()]
    results_file = f"{batch.id}_results.jsonl"
    assert results_file in [f.filename for f in alice.files.list(purpose="batch_output")]
    claude.messages.batches.delete(batch.id)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.batches.retrieve(batch.id)
    assert results_file not in [f.filename for f in alice.files.list(purpose="batch_output")]


def test_a_cancelled_message_batch_ends_with_its_requests_canceled(claude: anthropic.Anthropic):
    requests = [
        {"custom_id": f"c-{n}", "params": messages_params(f"{TOPICS[n % 8]} {n}", 24)}
        for n in range(24)
    ]
    batch = claude.messages.batches.create(requests=requests)
    deadline = time.monotonic() + 120
    while claude.messages.batches.retrieve(batch.id).request_counts.succeeded < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert claude.messages.batches.cancel(batch.id).processing_status == "canceling"
    done = ended(claude, batch.id)
    counts = done.request_counts
    assert counts.canceled > 0 and counts.succeeded >= 2 and counts.processing == 0
    assert counts.succeeded + counts.canceled == len(requests)
    kinds = [r.result.type for r in claude.messages.batches.results(batch.id)]
    assert (
        kinds.count("succeeded") == counts.succeeded and kinds.count("canceled") == counts.canceled
    )


def test_what_is_not_done_when_the_window_closes_expires(claude: anthropic.Anthropic):
    # far more work than the window allows: long stories (the default model writes hundreds
    # of tokens for one), several minutes of decoding for four streams at 400 tok/s
    story = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    params = {"model": "default", "max_tokens": 400, "messages": story, "temperature": 0}
    requests = [{"custom_id": f"e-{n}", "params": params} for n in range(128)]
    batch = claude.messages.batches.create(requests=requests)
    done = ended(claude, batch.id, timeout=WINDOW_S + 60)
    counts = done.request_counts
    assert counts.expired > 0 and counts.succeeded + counts.expired == len(requests)
    kinds = [r.result.type for r in claude.messages.batches.results(batch.id)]
    assert kinds.count("expired") == counts.expired


def test_a_malformed_message_batch_is_refused_in_anthropic_s_shape(claude: anthropic.Anthropic):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.batches.create(
            requests=[{"custom_id": "same", "params": messages_params("sea")}] * 2
        )
    assert caught.value.body["type"] == "error" and "twice" in caught.value.message
