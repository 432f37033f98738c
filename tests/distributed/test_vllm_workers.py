"""``sluice worker --engine vllm``: the official SDKs against ``sluice serve --redis`` with two
workers hosting vLLM's CPU build, on a small random Llama saved as transformers saves it.

The workers run from the vLLM environment ``make install`` builds (``.venv-vllm``), the
API from the project's own; both read the same checkpoint. vLLM's own OpenAI server on the
same checkpoint gives the reference for greedy answers: same tokens in, same tokens out.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest
import redis
from openai import OpenAI
from openai.types.chat import ChatCompletionChunk
from prometheus_client.parser import text_string_to_metric_families

from bench.queue import tiny_model
from shared import keys
from shared.event_codec import Entry, decode_entry
from shared.events import Finish, Text
from shared.prefix_hash import digest, prefix_hashes
from shared.task_message import REQUEST_HEADER
from tests.distributed.conftest import (
    CHILD_ENV,
    ROOT,
    Child,
    RedisServer,
    live_reports,
    wait_until,
)
from tests.servers import free_port

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MODEL = "tiny"
MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT_S = 240
KV_CACHE_BYTES = 64 * 2**20
MESSAGES = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
RUNNING = "vllm:num_requests_running"


def vllm_checkpoint(directory: Path) -> Path:
    """A two-layer random Llama with heads of 64 (vLLM's CPU attention takes no smaller),
    the default model's tokenizer, saved by transformers; its registry file."""
    import torch
    import transformers

    small = tiny_model(directory / "small").parent / "tiny-llama"
    weights = directory / "tiny-vllm"
    weights.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (weights / name).write_bytes((small / name).read_bytes())
    small_config = json.loads((small / "config.json").read_text())
    config = transformers.LlamaConfig(
        vocab_size=small_config["vocab_size"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2 * MAX_MODEL_LEN,
        tie_word_embeddings=True,
        bos_token_id=small_config["bos_token_id"],
        eos_token_id=small_config["eos_token_id"],
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(weights, safe_serialization=True)
    registry = directory / "registry.toml"
    registry.write_text(
        f'[models.{MODEL}]\nweights = "{weights}"\nprompt_format = "chatml"\n'
        f"context_length = {MAX_MODEL_LEN}\n"
    )
    return registry


class VllmFleet:
    """Redis, the API and two vLLM workers; ``kill`` replaces nothing."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.registry = vllm_checkpoint(directory)
        self.redis = RedisServer(directory)
        self.redis.start()
        self.workers: dict[str, Child] = {}
        self.metrics_ports: dict[str, int] = {}
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.api = Child.spawn(
            [
                sys.executable, "-m", "api.server", "--redis", self.redis.url,
                "--config", str(self.registry), "--model", MODEL, "--port", str(port),
                "--queue-timeout", "60", "--first-token-timeout", "90", "--total-timeout", "120",
            ],
            directory / "api.log",
        )  # fmt: skip
        for index in (1, 2):
            self.start_worker(f"v{index}", cpu=str(index - 1))

    def start_worker(self, worker_id: str, cpu: str) -> None:
        self.metrics_ports[worker_id] = free_port()
        command = [
            str(VLLM_PYTHON), "-m", "workers.main", "--engine", "vllm",
            "--redis", self.redis.url, "--config", str(self.registry), "--model", MODEL,
            "--worker-id", worker_id, "--max-num-seqs", "4", "--enforce-eager",
            "--drain-grace", "0", "--loglevel", "WARNING",
            "--engine-arg", f"kv_cache_memory_bytes={KV_CACHE_BYTES}",
            "--metrics-port", str(self.metrics_ports[worker_id]),
        ]  # fmt: skip
        env = {**CHILD_ENV, "VLLM_CPU_OMP_THREADS_BIND": cpu}
        self.workers[worker_id] = Child.spawn(command, self.directory / f"{worker_id}.log", env)

    def wait_live(self) -> None:
        """Until every worker started reports itself live (a killed one's last report may
        linger) and the API is ready."""

        def live() -> bool:
            for worker_id, child in self.workers.items():
                if not child.alive:
                    pytest.fail(f"worker {worker_id} exited:\n{child.log()}")
            return set(self.workers) <= set(self.reports()) and self._api_ready()

        wait_until(live, STARTUP_TIMEOUT_S, f"workers {sorted(self.workers)} live", interval=0.5)

    def reports(self) -> dict[str, dict]:
        try:
            return live_reports(self.redis.client, MODEL)
        except redis.ConnectionError:
            return {}

    def _api_ready(self) -> bool:
        if not self.api.alive:
            pytest.fail(f"the API exited:\n{self.api.log()}")
        try:
            return httpx.get(f"{self.url}/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        for child in [*self.workers.values(), self.api]:
            child.stop(signal.SIGKILL, timeout=10)
        self.redis.kill()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    assert VLLM_PYTHON.is_file(), "no vLLM environment: run `make install`"
    started = VllmFleet(tmp_path_factory.mktemp("vllm"))
    try:
        started.wait_live()
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def client(fleet: VllmFleet) -> OpenAI:
    return OpenAI(base_url=f"{fleet.url}/v1", api_key="sk-local", max_retries=0, timeout=120)


def test_the_sdks_stream_and_answer_in_three_protocols(fleet: VllmFleet, client: OpenAI):
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    assert len(whole.choices[0].logprobs.content[0].top_logprobs) == 2
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and chunks[-1].usage.total_tokens > 12

    answer = client.responses.create(model=MODEL, input="Hello", max_output_tokens=8)
    assert answer.status == "incomplete" and answer.usage.output_tokens == 8

    messages = anthropic.Anthropic(base_url=fleet.url, api_key="sk-local", max_retries=0)
    with messages.messages.stream(model=MODEL, max_tokens=8, messages=MESSAGES) as events:
        message = events.get_final_message()
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 8


def test_a_json_schema_and_a_forced_call_validate(client: OpenAI):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "days": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["city", "days"],
    }
    answer = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": schema}},
        extra_body={"logit_bias": {"97": 5}},
    )  # fmt: skip
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)

    tool = {"type": "function", "function": {"name": "forecast", "parameters": schema}}
    called = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0, tools=[tool],
        tool_choice={"type": "function", "function": {"name": "forecast"}},
    )  # fmt: skip
    [call] = called.choices[0].message.tool_calls
    assert call.function.name == "forecast"
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_greedy_answers_equal_vllm_s_own_server(
    fleet: VllmFleet, client: OpenAI, tmp_path_factory: pytest.TempPathFactory
):
    """Token ids in, the same completion out, for prompts of several lengths."""
    prompts = [[1, 504, 2681, 30, 11], list(range(200, 260)), [1, *range(4000, 4300, 3)]]
    ours = _greedy_completions(client, prompts)
    port = free_port()
    weights = fleet.directory / "tiny-vllm"
    command = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(weights),
        "--served-model-name", MODEL, "--port", str(port), "--enforce-eager",
        "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
    ]  # fmt: skip
    log_path = tmp_path_factory.mktemp("vllm-server") / "server.log"
    server = Child.spawn(command, log_path, {**CHILD_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    try:
        base = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            if not server.alive:
                pytest.fail(f"vLLM's server exited:\n{server.log()}")
            try:
                return httpx.get(f"{base}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, STARTUP_TIMEOUT_S, "vLLM's own server", interval=0.5)
        reference = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        theirs = _greedy_completions(reference, prompts)
        tokenized = [_tokenization(url) for url in (fleet.url, base)]
    finally:
        server.stop(signal.SIGKILL)
    assert ours == theirs and all(ours)
    assert tokenized[0] == tokenized[1]


def _tokenization(base_url: str) -> list[dict]:
    """A server's answers to vLLM's ``/tokenize`` (a prompt, messages) and ``/detokenize``.

    The messages carry a system message: the checkpoint's own chat template writes a
    default one where the registry's ``chatml`` writes none. The prompt spells no special
    token: Sluice tokenizes such text as text, where vLLM reads the token."""
    asked = [
        ("/tokenize", {"prompt": "Hello world, lighthouses.", "return_token_strs": True}),
        ("/tokenize", {"messages": [{"role": "system", "content": "Be brief."}, *MESSAGES]}),
        ("/detokenize", {"tokens": [1, 504, 2681, 30, 11, 2]}),
    ]
    answers = []
    for path, body in asked:
        response = httpx.post(f"{base_url}{path}", json={"model": MODEL, **body}, timeout=30)
        assert response.status_code == 200, (base_url, path, response.text)
        answers.append(response.json())
    return answers


def _greedy_completions(client: OpenAI, prompts: list[list[int]]) -> list[str]:
    """Each prompt's 24 greedy tokens, end of sequence ignored, as text."""
    return [
        client.completions.create(
            model=MODEL, prompt=ids, max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True},
        ).choices[0].text
        for ids in prompts
    ]  # fmt: skip


def test_sampling_fields_reach_vllm(client: OpenAI):
    """A seed repeats its draw; a stop string ends the text where it starts."""
    seeded = [
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=16, temperature=1.5, seed=7,
        ).choices[0].message.content
        for _ in range(2)
    ]  # fmt: skip
    assert seeded[0] == seeded[1]
    free = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0]  # fmt: skip
    text = free.message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]  # fmt: skip
    assert cut.finish_reason == "stop" and cut.message.content == text[: text.index(stop)]


def test_each_later_turn_lands_where_vllm_caches_its_prefix(fleet: VllmFleet, client: OpenAI):
    """vLLM's KV-cache events name its cached blocks in Sluice's digests: the summary holds
    each turn's prompt on the worker that ran it, and the next turn is placed there."""
    words = " ".join(f"rule {index}: answer briefly." for index in range(60))
    messages = [{"role": "system", "content": f"Conversation {time.time_ns()}. {words}"}]
    before = _placements(fleet.url)
    holder = None
    for turn in range(3):
        messages.append({"role": "user", "content": f"Question {turn}: name a colour."})
        prompt_ids = _tokenize(fleet.url, messages)
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0
        )
        cached = reply.usage.prompt_tokens_details.cached_tokens
        found = wait_until(lambda ids=prompt_ids: _holders(fleet, ids), 5, "a holder")
        assert len(found) == 1 and (holder is None or found == {holder}), (turn, holder, found)
        holder = found.pop()
        block = fleet.reports()[holder]["block_size"]
        assert turn == 0 or cached >= block, (turn, cached)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert _placements(fleet.url).get("prefix", 0) - before.get("prefix", 0) >= 2


def _tokenize(base_url: str, messages: list[dict]) -> list[int]:
    body = {"model": MODEL, "messages": messages}
    response = httpx.post(f"{base_url}/v1/tokenize", json=body, timeout=30)
    response.raise_for_status()
    return response.json()["token_ids"]


def _holders(fleet: VllmFleet, prompt_ids: list[int]) -> set[str]:
    """The workers whose cache summary names every full block of ``prompt_ids`` but the last."""
    found = set()
    for worker_id, report in fleet.reports().items():
        block = report["block_size"]
        usable = (len(prompt_ids) - 1) // block * block
        digests = [digest(h) for h in prefix_hashes(prompt_ids[:usable], block)]
        summary = keys.cache_summary(worker_id)
        if digests and all(fleet.redis.client.smismember(summary, digests)):
            found.add(worker_id)
    return found


def _placements(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    pattern = r'^sluice_placements_total\{model="[^"]+",placement="(\w+)"\} (\S+)$'
    return {kind: float(value) for kind, value in re.findall(pattern, text, re.MULTILINE)}


def test_workers_and_the_api_report_vllm_s_engine_series(fleet: VllmFleet, client: OpenAI):
    """Mid-stream, the serving worker's own /metrics and the API's fleet view (read from the
    heartbeats, a second or two behind) say one request runs and KV blocks are in use;
    after it, none runs.

    The request is held mid-stream: the serving worker's vLLM model process is stopped
    (SIGSTOP) once a token is out, so the engine waits inside its next step while the
    worker's metrics and heartbeats go on, however long the test takes to read them."""
    with _held_mid_stream(fleet, client) as streaming:
        try:
            url = _metrics_url(fleet, streaming.worker_id)
            worker = wait_until(
                lambda: (series := _engine_series(url))[RUNNING] == 1 and series,
                10,
                "the worker's series to show the request",
            )
            api = wait_until(
                lambda: (series := _engine_series(fleet.url))[RUNNING] == 1 and series,
                10,
                "the API's fleet view to show the request",
            )
            idle = [w for w in fleet.workers if w != streaming.worker_id]
            assert all(_engine_series(_metrics_url(fleet, w))[RUNNING] == 0 for w in idle)
        finally:
            _signal_model(fleet, streaming, signal.SIGCONT)
        streaming.chunks()
    assert worker["vllm:num_requests_waiting"] == api["vllm:num_requests_waiting"] == 0
    assert 0 < worker["vllm:kv_cache_usage_perc"] < 1 and 0 < api["vllm:kv_cache_usage_perc"] < 1
    assert worker["vllm:num_preemptions_total"] == 0
    wait_until(lambda: _engine_series(fleet.url)[RUNNING] == 0, 10, "the end")


@contextmanager
def _held_mid_stream(fleet: VllmFleet, client: OpenAI, tries: int = 3) -> Iterator[Streaming]:
    """A stream whose worker's vLLM model process is stopped after its first token.

    A stream whose end was written before the stop took hold (its test process kept off
    the cores for its whole length) is read to its end and sent again, up to ``tries``
    times: the hold is what the caller needs, not the first request."""
    for _ in range(tries):
        with _streaming(fleet, client, max_tokens=900) as streaming:
            _signal_model(fleet, streaming, signal.SIGSTOP)
            if not streaming.finished():
                yield streaming
                return
            _signal_model(fleet, streaming, signal.SIGCONT)
            streaming.chunks()
    pytest.fail(f"every one of {tries} streams ended before its worker could be stopped")


def _signal_model(fleet: VllmFleet, streaming: Streaming, signum: signal.Signals) -> None:
    """Send ``signum`` to the processes of the stream's worker (vLLM's model process)."""
    held = _children(fleet.workers[streaming.worker_id].process.pid)
    assert held  # vLLM's model runs in a process of its own on CPUs
    for pid in held:
        os.kill(pid, signum)


def _metrics_url(fleet: VllmFleet, worker_id: str) -> str:
    return f"http://127.0.0.1:{fleet.metrics_ports[worker_id]}"


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (vLLM's model process among them), from /proc."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _engine_series(base_url: str) -> dict[str, float]:
    """The model's vLLM engine series at ``base_url``/metrics."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("vllm:num_") or sample.name == "vllm:kv_cache_usage_perc"
        if sample.labels.get("model_name") == MODEL
    }


def test_a_drained_worker_hands_its_stream_to_the_other(fleet: VllmFleet, client: OpenAI):
    """SIGTERM with no grace mid-stream: the run goes back to the queue and the other worker
    finishes it, every token once, in one more attempt that writes (the hand-back deletes
    the job's taken record, so it is not restored a second time when the worker is gone;
    the draining worker may still take the job back once and hand it on, an attempt that
    writes nothing); a replacement starts for the tests after."""
    try:
        text, attempts, tokens = _interrupted_stream(fleet, client, signal.SIGTERM, 800)
    finally:
        fleet.start_worker("v3", cpu="0")
        fleet.wait_live()
    assert len(attempts) == 2 and min(attempts) == 1 and tokens == 800 and text


def test_a_cancelled_stream_stops_the_engine(fleet: VllmFleet, client: OpenAI):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=900, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for index, _ in enumerate(stream):
        if index == 3:
            break
    stream.close()
    since = time.time()

    def idle() -> bool:
        reports = fleet.reports()
        fresh = [r for r in reports.values() if r["ts"] > since + 0.5]
        return len(fresh) == len(fleet.workers) and not any(r["running"] for r in fresh)

    wait_until(idle, 10, "the engines to stop the cancelled request")


def test_a_killed_worker_s_stream_resumes_on_the_other(fleet: VllmFleet, client: OpenAI):
    """``kill -9`` mid-stream: the survivor resumes, every token arrives once."""
    text, attempts, tokens = _interrupted_stream(fleet, client, signal.SIGKILL, max_tokens=800)
    assert attempts == {1, 2} and tokens == 800 and text


def _interrupted_stream(
    fleet: VllmFleet, client: OpenAI, sig: int, max_tokens: int
) -> tuple[str, set[int], int]:
    """Stream a greedy answer, send ``sig`` to the worker serving it once it has streamed a
    token, read the rest: the client's text (checked to be the text the stream's events
    carry, in order), the attempts that wrote them, and how many tokens they carry.

    The worker is stopped (SIGSTOP to its process group) while it is signalled, so it
    writes nothing more in between, and its answer is unfinished."""
    with _streaming(fleet, client, max_tokens) as streaming:
        group = fleet.workers[streaming.worker_id].process.pid
        os.killpg(group, signal.SIGSTOP)
        try:
            assert not streaming.finished()
            os.kill(group, sig)
        finally:
            os.killpg(group, signal.SIGCONT)
        chunks = streaming.chunks()
    fleet.workers.pop(streaming.worker_id).stop(signal.SIGKILL)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == max_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    entries = _entries(fleet, streaming.request_id)
    texts = [entry for entry in entries if isinstance(entry.event, Text)]
    assert "".join(entry.event.text for entry in texts) == text
    tokens = sum(len(entry.event.token_ids) for entry in texts)
    return text, {entry.attempt for entry in texts}, tokens


@dataclass
class Streaming:
    """A greedy stream read on a thread of its own; see ``_streaming``."""

    fleet: VllmFleet
    worker_id: str  # the worker holding its job
    request_id: str
    read: Future[list[ChatCompletionChunk]]
    go: threading.Event  # set: the client reads on

    def finished(self) -> bool:
        """Whether its Finish is in Redis."""
        return any(isinstance(e.event, Finish) for e in _entries(self.fleet, self.request_id))

    def chunks(self) -> list[ChatCompletionChunk]:
        """Every chunk the client read, once the stream has ended (the workers at their own
        priority again)."""
        _renice(self.fleet, 0)
        self.go.set()
        return self.read.result(timeout=120)


@contextmanager
def _streaming(fleet: VllmFleet, client: OpenAI, max_tokens: int) -> Iterator[Streaming]:
    """A greedy stream of ``max_tokens`` (``ignore_eos``), from the moment its first token is
    in Redis. The tiny model streams a token every few milliseconds, faster than a test
    process that shares the cores can follow through the API and the SDK, so the test
    watches Redis as the stream's worker writes it, the client reads nothing until
    ``chunks`` (its parsing would compete with the watching), and the workers run at the
    lowest priority until then: on busy cores, the test, Redis and the API go first."""
    go = threading.Event()

    def read() -> list[ChatCompletionChunk]:
        stream = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        go.wait()
        return list(stream)

    held = [keys.taken(worker_id) for worker_id in fleet.workers]
    wait_until(lambda: not fleet.redis.client.exists(*held), 10, "earlier jobs to be acked")
    _renice(fleet, 19)
    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(read)
        try:
            worker_id, request_id = wait_until(lambda: _taken(fleet), 30, "a worker to take it")
            events = keys.event_stream(request_id)
            # Accepted, Ready and the first token
            wait_until(lambda: fleet.redis.client.xlen(events) >= 3, 30, "a token", interval=0.001)
            yield Streaming(fleet, worker_id, request_id, reading, go)
        finally:
            _renice(fleet, 0)
            go.set()


def _renice(fleet: VllmFleet, niceness: int) -> None:
    """Set every worker's processes and threads (its process group) to ``niceness``; going
    back up needs privileges a test may lack, and a killed worker's group may be gone."""
    for child in fleet.workers.values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.setpriority(os.PRIO_PGRP, child.process.pid, niceness)


def _taken(fleet: VllmFleet) -> tuple[str, str] | None:
    """The worker holding a job in its taken records, and the job's request id (the one
    job taken; its message's headers name it)."""
    for worker_id in fleet.workers:
        for record in fleet.redis.client.hvals(keys.taken(worker_id)):
            message = json.loads(record.split("\n", 2)[2])
            return worker_id, message["headers"][REQUEST_HEADER][0]
    return None


def _entries(fleet: VllmFleet, request_id: str) -> list[Entry]:
    stream = fleet.redis.client.xrange(keys.event_stream(request_id))
    return [decode_entry(request_id, fields) for _, fields in stream]
