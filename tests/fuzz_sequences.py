"""Sequences of calls against a real server: one state machine over its stored objects.

``SequenceMachine`` is a Hypothesis rule-based state machine over files, OpenAI
batches, Anthropic message batches, stored and background responses and jobs:
it creates, reads, lists, streams, cancels and deletes them with any of the
server's API keys, with cursors of every kind (any integer, any text, the
caller's own ids, other keys' ids, ids of other kinds). The embedded and the
distributed fuzz tests run the same machine (``run_sequences``) against a
server started with ``server_options``: a few API keys, small file limits and
a short batch completion window, so cross-key access and quota edges are
reached in a few steps.

Every answer is checked (``Wire.send``): below 500 (a 503 with ``Retry-After``,
the answer to overload, is the one exception) and within ``CALL_TIMEOUT_S``; a
stream is read within ``STREAM_BYTES`` and ``CALL_TIMEOUT_S`` and holds no
server error. Every rule checks its answer against a model of what each key
holds:

- another key's object is a 404 on every route (read, content, stream,
  cancel, delete, results, input items, as an input file or a
  ``previous_response_id``) and absent from every list;
- a key's ``purpose=batch`` files never hold more than the limits, and an
  upload that would pass them is a 413; those listed are the model's;
- a deleted object is a 404; a list shows the key's live objects and none
  it deleted; a terminal status never changes;
- cursors: a page after one of the caller's ids is the slice of the full
  list after it, a cursor that is not one of them gives an empty page,
  pages chained by ``after`` give the full list, ``asc`` is ``desc``
  reversed; an event stream resumed after ``n`` starts at ``n + 1``.

``HealthPoller`` polls ``/health`` from a thread meanwhile and keeps the
latencies. Every generation asks for 1 to 4 tokens and batch files hold 1 to
3 lines, so a step costs little. A failure names the call as a curl line and
shows the calls of its sequence so far (``$BASE``, ``$KEY_A``...).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NoReturn

import httpx
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

CALL_TIMEOUT_S = 15.0
STREAM_BYTES = 256 * 2**10
HEALTH_INTERVAL_S = 0.05
HEALTH_LIMIT_S = 3.0  # the slowest /health answer allowed while the machine runs
MAX_EVENT = 2**53 - 1  # the largest event cursor the server takes (api/cursors.py)
MAX_ID_LENGTH = 256  # the longest list cursor it takes
TRANSCRIPT_TAIL = 60
GENERATIONS = 30  # generation requests one sequence may make (batch lines included)
DRAIN_S = 60.0  # how long the jobs a sequence left may take to end
KEY_NAMES = "ABCDEFGH"

JOB_TERMINAL = {"completed", "failed", "cancelled", "expired"}
JOB_STATUSES = {"queued", "running", *JOB_TERMINAL}
RESPONSE_TERMINAL = {"completed", "incomplete", "failed", "cancelled"}
RESPONSE_STATUSES = {"queued", "in_progress", *RESPONSE_TERMINAL}
BATCH_TERMINAL = {"completed", "cancelled", "failed", "expired"}
BATCH_STATUSES = {"validating", "in_progress", "finalizing", "cancelling", *BATCH_TERMINAL}
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
JOB_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
# The error types a 5xx carries inside a stream: the three protocols' spellings.
SERVER_ERROR = re.compile(rb'"(api_error|server_error|timeout_error)"')
LINE_JOB = re.compile(r"job_([0-9a-f]{24})[0-9a-f]{8}")  # a batch line's job: batch hex, index
OUTPUT_FILE = re.compile(r"((?:msg)?batch_[0-9a-f]{24})_(?:output|error|results)\.jsonl")
PROMPT = "Say one word."


# --- the server under test --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    """The server: its URL, its API keys (two or more) and the file limits it runs with."""

    base_url: str
    keys: tuple[str, ...]
    max_file_bytes: int = 2048
    max_bytes_per_key: int = 4096
    max_files_per_key: int = 3
    completion_window_s: float = 8.0


def server_options(target: Target) -> list[str]:
    """The ``api.server`` flags that give a server ``target``'s keys and limits."""
    options = []
    for key in target.keys:
        options += ["--api-key", key]
    return [
        *options,
        "--max-file-bytes", str(target.max_file_bytes),
        "--max-file-bytes-per-key", str(target.max_bytes_per_key),
        "--max-files-per-key", str(target.max_files_per_key),
        "--batch-completion-window", str(target.completion_window_s),
        "--batch-concurrency", "2",
    ]  # fmt: skip


def fuzz_settings(examples: int, steps: int) -> settings:
    """Fixed examples (times ``SLUICE_FUZZ_SCALE``) of ``steps`` steps each, no deadline.

    A failure is reported as it was found, with the calls that led to it: replaying
    sequences against a live server to shrink one takes minutes. ``SLUICE_FUZZ_SHRINK=1``
    shrinks it to the shortest sequence Hypothesis finds.
    """
    phases = set(Phase) - (set() if os.environ.get("SLUICE_FUZZ_SHRINK") else {Phase.shrink})
    return settings(
        max_examples=examples * int(os.environ.get("SLUICE_FUZZ_SCALE", "1")),
        stateful_step_count=steps,
        deadline=None,
        derandomize=True,
        database=None,
        phases=phases,
        report_multiple_bugs=False,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )


# --- /health, polled meanwhile -----------------------------------------------------------


class HealthPoller:
    """Polls ``GET /health`` from a thread while it is entered; keeps every latency.

    A poll that fails, is not a 200 or takes longer than ``HEALTH_LIMIT_S`` is a problem.
    """

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.latencies: list[float] = []
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="health-poller", daemon=True)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=CALL_TIMEOUT_S)

    def _poll(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=CALL_TIMEOUT_S) as http:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    status = http.get("/health").status_code
                except httpx.HTTPError as exc:
                    self.problems.append(f"GET /health failed: {exc!r}")
                    status = None
                took = time.monotonic() - started
                self.latencies.append(took)
                if status is not None and status != 200:
                    self.problems.append(f"GET /health answered {status}")
                if took > HEALTH_LIMIT_S:
                    self.problems.append(f"GET /health took {took:.2f}s")
                self._stop.wait(HEALTH_INTERVAL_S)

    def quantile(self, q: float) -> float:
        """The ``q`` quantile of the latencies so far, in seconds (0 without any)."""
        if len(self.latencies) < 2:
            return self.latencies[0] if self.latencies else 0.0
        return statistics.quantiles(self.latencies, n=1000, method="inclusive")[
            min(998, max(0, round(q * 1000) - 1))
        ]

    def summary(self) -> str:
        if not self.latencies:
            return "/health: no poll"
        return (
            f"/health: {len(self.latencies)} polls, p50 {self.quantile(0.5) * 1000:.1f} ms, "
            f"p99 {self.quantile(0.99) * 1000:.1f} ms, max {max(self.latencies) * 1000:.1f} ms"
        )


# --- sending and checking one call ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Event:
    """One server-sent event: its ``id:``, ``event:`` and ``data:`` fields."""

    id: str | None
    event: str | None
    data: str


@dataclass(slots=True)
class Answer:
    status: int
    headers: httpx.Headers
    content: bytes
    events: list[Event] | None = None  # a 200 stream's events

    @property
    def body(self) -> Any:
        return json.loads(self.content)

    @property
    def overloaded(self) -> bool:
        return self.status == 503 and "retry-after" in self.headers


@dataclass(slots=True)
class Call:
    """One request, sent with key number ``who`` (-1: a key the server does not know)."""

    method: str
    path: str
    who: int
    params: list[tuple[str, str]] = field(default_factory=list)
    body: Any = None
    upload: tuple[bytes, str | None] | None = None  # a multipart file and its purpose
    headers: dict[str, str | bytes] = field(default_factory=dict)

    def __str__(self) -> str:
        key = "$KEY_X" if self.who < 0 else f"$KEY_{KEY_NAMES[self.who]}"
        query = str(httpx.QueryParams(self.params))
        line = f'curl -X {self.method} "$BASE{self.path}{"?" + query if query else ""}"'
        line += f' -H "Authorization: Bearer {key}"'
        line += "".join(
            f" -H {shlex.quote(f'{name}: {shown(value)}')}" for name, value in self.headers.items()
        )
        if self.body is not None:
            line += f" -H 'content-type: application/json' -d {shlex.quote(json.dumps(self.body))}"
        if self.upload is not None:
            content, purpose = self.upload
            line += (
                f" -F 'file=@input.jsonl' (input.jsonl: {len(content)} bytes: {content[:120]!r})"
            )
            line += "" if purpose is None else f" -F 'purpose={purpose}'"
        return line


def shown(value: str | bytes) -> str:
    """A header value as a shell may pass it: bytes read as Latin-1, controls escaped."""
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    return text.encode("unicode_escape").decode("ascii")


class Wire:
    """Sends calls with the target's keys, checks what every answer must keep, and keeps the
    transcript of the current sequence."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.http = httpx.Client(base_url=target.base_url, timeout=CALL_TIMEOUT_S)
        self.calls = 0
        self.transcript: list[str] = []

    def close(self) -> None:
        self.http.close()

    def key(self, who: int) -> str:
        return "sk-unknown-to-the-server" if who < 0 else self.target.keys[who]

    def send(self, call: Call) -> Answer:
        """The answer to ``call``: below 500 (or an overload's 503), in time, and a stream
        read whole within its bounds, without a server error in it."""
        self.calls += 1
        started = time.monotonic()
        try:
            answer = self._exchange(call, started)
        except httpx.TimeoutException:
            self.fail(f"no answer within {CALL_TIMEOUT_S:g}s (a hang)", call)
        except httpx.TransportError as exc:
            self.fail(f"the connection failed ({exc!r})", call)
        took = time.monotonic() - started
        self.transcript.append(f"{call}  -> {answer.status} ({took * 1000:.0f} ms)")
        if took > CALL_TIMEOUT_S:
            self.fail(f"answered after {took:.1f}s (a hang)", call)
        if answer.status >= 500 and not answer.overloaded:
            self.fail(f"a server error: {answer.status} {answer.content[:1000]!r}", call)
        if answer.events is not None and SERVER_ERROR.search(answer.content):
            self.fail(f"a server error in the stream: {answer.content[:2000]!r}", call)
        return answer

    def _exchange(self, call: Call, started: float) -> Answer:
        headers = {"authorization": f"Bearer {self.key(call.who)}", **call.headers}
        files = data = None
        if call.upload is not None:
            content, purpose = call.upload
            files = {"file": ("input.jsonl", content, "application/jsonl")}
            data = {} if purpose is None else {"purpose": purpose}
        with self.http.stream(
            call.method, call.path, params=call.params, json=call.body, files=files,
            data=data, headers=headers,
        ) as response:  # fmt: skip
            content = bytearray()
            for chunk in response.iter_bytes():
                content += chunk
                if len(content) > STREAM_BYTES:
                    self.fail(f"more than {STREAM_BYTES} bytes: {bytes(content[:500])!r}", call)
                if time.monotonic() - started > CALL_TIMEOUT_S:
                    self.fail(f"the answer took longer than {CALL_TIMEOUT_S:g}s (a hang)", call)
            streamed = "text/event-stream" in response.headers.get("content-type", "")
            events = parse_events(bytes(content)) if streamed and response.is_success else None
            return Answer(response.status_code, response.headers, bytes(content), events)

    def fail(self, problem: str, call: Call | None = None) -> NoReturn:
        """Raise ``AssertionError`` naming the problem, the call and the sequence so far."""
        shown = "" if call is None else f"\n  {call}"
        calls = "\n  ".join(self.transcript[-TRANSCRIPT_TAIL:])
        raise AssertionError(f"{problem}{shown}\nthe calls of this sequence so far:\n  {calls}")


def parse_events(content: bytes) -> list[Event]:
    """The events of an SSE body (comments, such as pings, left out)."""
    events = []
    for block in content.decode("utf-8", "replace").replace("\r\n", "\n").split("\n\n"):
        fields: dict[str, list[str]] = {}
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            fields.setdefault(name, []).append(value.removeprefix(" "))
        if fields:
            ids, names = fields.get("id", [None]), fields.get("event", [None])
            events.append(Event(ids[-1], names[-1], "\n".join(fields.get("data", []))))
    return events


# --- the model -------------------------------------------------------------------------------


@dataclass(slots=True)
class FileModel:
    id: str
    owner: int
    content: bytes
    endpoint: str | None  # the url of its lines when it is valid batch input, else None
    deleted: bool = False


@dataclass(slots=True)
class BatchModel:
    """An OpenAI batch (``api`` openai) or an Anthropic message batch (anthropic)."""

    id: str
    owner: int
    api: str
    custom_ids: list[str]
    terminal: str | None = None  # the terminal status once seen (ended: the message batch's)
    deleted: bool = False


@dataclass(slots=True)
class JobModel:
    """A job, a stored or background response (its job), or a response never stored.

    ``job_id`` is ``job_<hex>``; a response's id is ``resp_<hex>``.
    """

    job_id: str
    owner: int
    endpoint: str
    is_job: bool = True  # False: a foreground response with store false (nothing kept)
    is_response: bool = False  # found by the Responses routes
    background: bool = False
    pending: bool = False  # a streamed foreground response: kept once its stream ended
    terminal: str | None = None  # the job's terminal status once seen
    response_terminal: str | None = None  # the response's, once seen
    deleted: bool = False

    @property
    def response_id(self) -> str:
        return "resp_" + self.job_id.removeprefix("job_")


@dataclass
class Run:
    """What outlives one sequence: the wire, the poller, who owns every id made so far, and
    the counts."""

    target: Target
    wire: Wire
    poller: HealthPoller
    owners: dict[str, int] = field(default_factory=dict)  # every id our calls made → key
    undrained: str | None = None  # what the last sequence left running too long
    sequences: int = 0
    steps: int = 0

    def owner_of(self, object_id: str, filename: str | None = None) -> int | None:
        """The key that made ``object_id`` (a batch line's job, a batch's output file:
        its batch's key), or None when none of our calls made it."""
        if object_id in self.owners:
            return self.owners[object_id]
        line = LINE_JOB.fullmatch(object_id)
        if line is not None:
            return self.owners.get(line.group(1))
        output = OUTPUT_FILE.fullmatch(filename or "")
        return None if output is None else self.owners.get(output.group(1))


# --- strategies ------------------------------------------------------------------------------

WHO = st.sampled_from((0, 1, 2))  # a key, by its number (modulo the number of keys)
# Who asks for an object: its owner (0), mostly, or the next key or the one after.
ASKER = st.sampled_from((0, 0, 0, 1, 2))
TOKENS = st.integers(1, 4)
ANY_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
# A list cursor: absent, one of the caller's ids or another's (picked from the model by
# number), any integer, any text, too long.
LIST_CURSOR = st.one_of(
    st.none(),
    st.tuples(st.just("own"), st.integers(0, 63)),
    st.tuples(st.just("foreign"), st.integers(0, 63)),
    st.tuples(st.just("elsewhere"), st.integers(0, 63)),
    st.one_of(
        st.integers(-(2**70), 2**70).map(str),
        ANY_TEXT,
        st.sampled_from(["", "x" * (MAX_ID_LENGTH + 1), "file-" + "0" * 24, "job_" + "0" * 24]),
    ),
)
# An event cursor: absent, a small number, any integer, the edges, any text.
EVENT_CURSOR = st.one_of(
    st.none(),
    st.integers(0, 12).map(str),
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(["", "-1", str(MAX_EVENT), str(MAX_EVENT + 1), "9" * 17, "1.5", "abc", "٣"]),
    ANY_TEXT,
)
LIMIT = st.sampled_from([1, 1, 2, 3, 5, 20, 100, 101, 1000, 1001, 0, -1, 10**6, -(2**40)])
# A file: batch input of 1 to 3 lines; or bytes, sized at the file limit (-1, 0, +1), at
# what the key has room for (-1, 0, +1), or any size.
FILE_CONTENT = st.one_of(
    st.tuples(st.just("jsonl"), st.sampled_from(BATCH_ENDPOINTS), st.integers(1, 3), TOKENS),
    st.tuples(st.sampled_from(["file limit", "room left"]), st.integers(-1, 1)),
    st.tuples(st.just("bytes"), st.integers(0, 2600)),
)
PURPOSE = st.sampled_from(["batch", "batch", "batch", "batch", "fine-tune", None])


def event_cursor_ok(value: str | None) -> bool:
    """Whether the server takes ``value`` as an event cursor (api/cursors.py's contract)."""
    if value is None or value == "":
        return True
    return value.isascii() and value.isdigit() and len(value) <= 16 and int(value) <= MAX_EVENT


def header_value(value: str) -> bytes:
    """``value`` made legal as a header on the wire: no NUL, CR, LF, no edge whitespace."""
    return re.sub(rb"[\x00\r\n\x0b\x0c]", b"", value.encode()).strip(b" \t")


def generation_body(endpoint: str, tokens: int) -> dict[str, Any]:
    """A cheap valid body for ``endpoint``: one short prompt, ``tokens`` tokens at most."""
    if endpoint == "/v1/responses":
        return {"model": "default", "input": PROMPT, "max_output_tokens": tokens}
    if endpoint == "/v1/completions":
        return {"model": "default", "prompt": PROMPT, "max_tokens": tokens}
    return {
        "model": "default",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
    }


def batch_lines(endpoint: str, count: int, tokens: int) -> bytes:
    lines = [
        {"custom_id": f"line-{n}", "method": "POST", "url": endpoint,
         "body": generation_body(endpoint, tokens)}
        for n in range(count)
    ]  # fmt: skip
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


# --- the machine ------------------------------------------------------------------------------


class SequenceMachine(RuleBasedStateMachine):
    """The rules; one instance per sequence, on the shared ``Run``."""

    files = Bundle("files")
    batches = Bundle("batches")
    message_batches = Bundle("message_batches")
    jobs = Bundle("jobs")  # job ids: jobs, stored and background responses, unstored ones
    responses = Bundle("responses")  # job ids of what has a response id
    anything = Bundle("anything")  # every id above

    def __init__(self, run: Run) -> None:
        super().__init__()
        self.run = run
        self.wire = run.wire
        self.keys = len(run.target.keys)
        self.file_models: dict[str, FileModel] = {}
        self.batch_models: dict[str, BatchModel] = {}
        self.job_models: dict[str, JobModel] = {}
        self.dirty_keys: set[int] = set()
        self.ghosts = 0
        self.made: list[tuple[str, int]] = []  # what this sequence made, in order, and whose
        self.generations = 0

    # --- helpers ---------------------------------------------------------------------------

    def who(self, number: int) -> int:
        return number % self.keys

    def asking(self, offset: int, owner: int) -> int:
        """The key ``offset`` places after ``owner``: the owner itself for 0."""
        return (owner + offset) % self.keys

    def send(self, method: str, path: str, who: int, **parts: Any) -> tuple[Call, Answer]:
        call = Call(method, path, who, **parts)
        return call, self.wire.send(call)

    def expect(self, call: Call, answer: Answer, allowed: int | set[int], what: str) -> bool:
        """Whether ``answer`` is one of ``allowed``; False for an overload's 503 (nothing was
        done); otherwise the failure."""
        allowed = {allowed} if isinstance(allowed, int) else allowed
        if answer.status in allowed:
            return True
        if answer.overloaded:
            return False
        self.wire.fail(
            f"{what}: answered {answer.status} {answer.content[:600]!r}, "
            f"expected {sorted(allowed)}",
            call,
        )
        return False

    def check(self, condition: bool, problem: str, call: Call | None = None) -> None:
        """Fail with ``problem`` (and ``call``) unless ``condition``."""
        if not condition:
            self.wire.fail(problem, call)

    def list_cursor(
        self, cursor: Any, who: int, own_ids: list[str], prefix: str = ""
    ) -> tuple[str | None, bool]:
        """The cursor to send, and whether it is one of ``own_ids`` (the caller's live ids of
        the listed kind, ids starting with ``prefix``); a picked id resolves against the
        model (another key's: of the same kind when there is one), or is absent. Picks go by
        the order things were made in this sequence, so that a replay picks the same."""
        if not isinstance(cursor, tuple):
            return cursor, cursor in own_ids
        kind, number = cursor
        if kind == "own":
            return (own_ids[number % len(own_ids)], True) if own_ids else (None, False)
        foreign = [i for i, owner in self.made if owner != who]
        alike = [i for i in foreign if i.startswith(prefix)]
        picked = (alike if kind == "foreign" and alike else foreign) or [prefix + "0" * 24]
        return picked[number % len(picked)], False

    def owned_visible(self, listed: list[dict[str, Any]], who: int, call: Call) -> None:
        """No listed object is another key's."""
        for item in listed:
            owner = self.run.owner_of(item["id"], item.get("filename"))
            self.check(
                owner is None or owner == who,
                f"key {KEY_NAMES[who]} sees {item['id']} of key "
                f"{KEY_NAMES[owner or 0]} in a list (a cross-key leak)",
                call,
            )

    def file_visible(self, file_id: str, who: int) -> bool:
        model = self.file_models.get(file_id)
        return model is not None and model.owner == who and not model.deleted

    def job_visible(self, job_id: str, who: int) -> bool:
        model = self.job_models.get(job_id)
        return model is not None and model.is_job and model.owner == who and not model.deleted

    def response_visible(self, job_id: str, who: int) -> bool:
        model = self.job_models.get(job_id)
        return model is not None and model.is_response and model.owner == who and not model.deleted

    def found(self, job_id: str, who: int, visible: bool) -> set[int]:
        """What reading a job or response may answer: 200 when ``visible``, else 404, or either
        while the key's streamed response may not be kept yet."""
        model = self.job_models[job_id]
        if visible:
            return {200, 404} if model.pending else {200}
        return {200, 404} if model.pending and model.owner == who and not model.deleted else {404}

    def batch_visible(self, batch_id: str, who: int, api: str) -> bool:
        model = self.batch_models.get(batch_id)
        return model is not None and model.api == api and model.owner == who and not model.deleted

    def held(self, who: int) -> tuple[int, int]:
        """The bytes and the number of the key's live uploaded files, in the model."""
        live = [f for f in self.file_models.values() if f.owner == who and not f.deleted]
        return sum(len(f.content) for f in live), len(live)

    def note_job_status(self, model: JobModel, status: str, call: Call) -> None:
        self.check(status in JOB_STATUSES, f"an unknown job status {status!r}", call)
        if model.terminal is not None:
            self.check(
                status == model.terminal,
                f"{model.job_id} was {model.terminal}, now {status}: a terminal status changed",
                call,
            )
        elif status in JOB_TERMINAL:
            model.terminal = status

    def note_response_status(self, model: JobModel, status: str, call: Call) -> None:
        self.check(status in RESPONSE_STATUSES, f"an unknown response status {status!r}", call)
        if model.response_terminal is not None:
            self.check(
                status == model.response_terminal,
                f"{model.response_id} was {model.response_terminal}, now {status}: "
                "a terminal status changed",
                call,
            )
        elif status in RESPONSE_TERMINAL:
            model.response_terminal = status

    def note_batch_status(self, model: BatchModel, status: str, call: Call) -> None:
        if model.terminal is not None:
            self.check(
                status == model.terminal,
                f"{model.id} was {model.terminal}, now {status}: a terminal status changed",
                call,
            )
        elif status in BATCH_TERMINAL or status == "ended":
            model.terminal = status

    def ghost(self, prefix: str) -> str:
        """An id that nothing has: what a refused creation adds to its bundles, so that what
        the bundles hold depends on the draws alone (the server's timing aside)."""
        self.ghosts += 1
        return f"{prefix}{self.ghosts:024x}"

    def ghost_file(self, who: int) -> str:
        file_id = self.ghost("file-")
        self.file_models[file_id] = FileModel(file_id, who, b"", None, deleted=True)
        return file_id

    def ghost_batch(self, who: int, api: str) -> str:
        batch_id = self.ghost("batch_" if api == "openai" else "msgbatch_")
        self.batch_models[batch_id] = BatchModel(batch_id, who, api, [], deleted=True)
        return batch_id

    def ghost_job(self, who: int, endpoint: str) -> str:
        job_id = self.ghost("job_")
        self.job_models[job_id] = JobModel(job_id, who, endpoint, is_job=False)
        return job_id

    def remember(self, object_id: str, who: int) -> None:
        self.run.owners[object_id] = who
        self.made.append((object_id, who))

    # --- every sequence starts with no uploaded file -------------------------------------------

    @initialize()
    def start(self) -> None:
        """Delete what earlier sequences uploaded, so the model starts with every quota free."""
        self.run.sequences += 1
        self.wire.transcript = []
        undrained, self.run.undrained = self.run.undrained, None
        self.check(undrained is None, f"the sequence before this one: {undrained}")
        for who in range(self.keys):
            for item in self.full_file_list(who, "batch", "desc"):
                call, answer = self.send("DELETE", f"/v1/files/{item['id']}", who)
                self.expect(call, answer, 200, "deleting an earlier sequence's file")

    def teardown(self) -> None:
        """Wait for the jobs of every key to end (``DRAIN_S`` at most), so that the next
        sequence starts on an idle server. What did not end is the next sequence's failure
        (a failure here would hide the one that ended this sequence)."""
        deadline = time.monotonic() + DRAIN_S
        try:
            for status, who in itertools.product(("queued", "running"), range(self.keys)):
                while self.unfinished(who, status) and time.monotonic() < deadline:
                    time.sleep(0.2)
                if time.monotonic() >= deadline:
                    self.run.undrained = (
                        f"key {KEY_NAMES[who]} still had {status} jobs {DRAIN_S:g}s after a "
                        "sequence ended"
                    )
                    return
        except AssertionError as exc:
            self.run.undrained = f"waiting for the jobs to end failed: {exc}"

    def unfinished(self, who: int, status: str) -> bool:
        """Whether the key lists a job of ours (not one of a key-less earlier client) with
        ``status``."""
        call, answer = self.send(
            "GET", "/v1/jobs", who, params=[("status", status), ("limit", "100")]
        )
        if not self.expect(call, answer, 200, "listing jobs"):
            return True
        return any(self.run.owner_of(job["id"]) is not None for job in answer.body["data"])

    @invariant()
    def health_answers(self) -> None:
        """``/health`` has answered every poll, each within ``HEALTH_LIMIT_S``."""
        self.run.steps += 1
        problems = self.run.poller.problems
        self.check(not problems, f"/health while the sequence ran: {problems[:5]}")

    @invariant()
    def quotas_hold(self) -> None:
        """The uploaded files of each key that uploaded or deleted: within the limits, and the
        model's."""
        target = self.run.target
        for who in sorted(self.dirty_keys):
            listed = self.full_file_list(who, "batch", "desc")
            size, count = sum(f["bytes"] for f in listed), len(listed)
            self.check(
                size <= target.max_bytes_per_key and count <= target.max_files_per_key,
                f"key {KEY_NAMES[who]} holds {count} files of {size} bytes, over the limits "
                f"({target.max_files_per_key} files, {target.max_bytes_per_key} bytes)",
            )
            live = {i for i, f in self.file_models.items() if f.owner == who and not f.deleted}
            self.check(
                {f["id"] for f in listed} == live,
                f"key {KEY_NAMES[who]} lists files {sorted(f['id'] for f in listed)}, "
                f"the model holds {sorted(live)}",
            )
        self.dirty_keys.clear()

    def full_file_list(self, who: int, purpose: str | None, order: str) -> list[dict[str, Any]]:
        params = [("limit", "10000"), ("order", order)]
        params += [] if purpose is None else [("purpose", purpose)]
        call, answer = self.send("GET", "/v1/files", who, params=params)
        self.expect(call, answer, 200, "listing files")
        body = answer.body
        self.check(not body["has_more"], "a full list of files says it has more", call)
        self.owned_visible(body["data"], who, call)
        return body["data"]

    # --- files --------------------------------------------------------------------------------

    @rule(targets=(files, anything), who=WHO, content=FILE_CONTENT, purpose=PURPOSE)
    def upload_file(self, who: int, content: tuple, purpose: str | None) -> Any:
        """413 past the file limit or the key's quota; 400 for a purpose other than batch."""
        who, target = self.who(who), self.run.target
        data, endpoint = self.file_bytes(who, content)
        held_bytes, held_count = self.held(who)
        over = (
            len(data) > target.max_file_bytes
            or held_bytes + len(data) > target.max_bytes_per_key
            or held_count + 1 > target.max_files_per_key
        )
        expected = 400 if purpose != "batch" else 413 if over else 200
        call, answer = self.send("POST", "/v1/files", who, upload=(data, purpose))
        self.dirty_keys.add(who)
        if not self.expect(call, answer, expected, "uploading a file") or expected != 200:
            return self.ghost_file(who)
        body = answer.body
        self.check(body["bytes"] == len(data) and body["purpose"] == "batch", "the file", call)
        self.file_models[body["id"]] = FileModel(body["id"], who, data, endpoint)
        self.remember(body["id"], who)
        return body["id"]

    @rule(
        targets=(files, anything),
        who=WHO,
        count=st.integers(2, 4),
        share=st.sampled_from([1, 2, 3]),
    )
    def upload_at_once(self, who: int, count: int, share: int) -> Any:
        """Uploads sent together, each a ``share``-th of what the key has room for: exactly
        those that fit are taken, the others are 413s."""
        who, target = self.who(who), self.run.target
        held_bytes, held_count = self.held(who)
        room = target.max_bytes_per_key - held_bytes
        size = min(target.max_file_bytes, max(1, room // share))
        fits = min(count, room // size, target.max_files_per_key - held_count)
        data = (b"sent together\n" * (size // 14 + 1))[:size]
        calls = [Call("POST", "/v1/files", who, upload=(data, "batch")) for _ in range(count)]
        with ThreadPoolExecutor(count) as pool:
            answers = list(pool.map(self.wire.send, calls))
        self.dirty_keys.add(who)
        ids = []
        for call, answer in zip(calls, answers, strict=True):
            if self.expect(call, answer, {200, 413}, "uploading at once") and answer.status == 200:
                file_id = answer.body["id"]
                self.file_models[file_id] = FileModel(file_id, who, data, None)
                self.remember(file_id, who)
                ids.append(file_id)
        self.check(
            len(ids) == fits,
            f"{len(ids)} of {count} uploads of {size} bytes sent together were taken, "
            f"{fits} fit the key's room ({room} bytes, {target.max_files_per_key - held_count} "
            "files)",
            calls[0],
        )
        return multiple(*ids, *(self.ghost_file(who) for _ in range(count - len(ids))))

    def file_bytes(self, who: int, content: tuple) -> tuple[bytes, str | None]:
        """The bytes a ``FILE_CONTENT`` draw stands for, and their endpoint when valid input."""
        kind, *rest = content
        if kind == "jsonl":
            endpoint, count, tokens = rest
            return batch_lines(endpoint, count, tokens), endpoint
        if kind == "file limit":
            size = self.run.target.max_file_bytes + rest[0]
        elif kind == "room left":
            size = max(0, self.run.target.max_bytes_per_key - self.held(who)[0] + rest[0])
        else:
            size = rest[0]
        return (b"not json lines\n" * (size // 15 + 1))[:size], None

    @rule(asker=ASKER, file=files, part=st.sampled_from(["", "/content"]))
    def read_file(self, asker: int, file: str, part: str) -> None:
        who = self.asking(asker, self.file_models[file].owner)
        visible = self.file_visible(file, who)
        call, answer = self.send("GET", f"/v1/files/{file}{part}", who)
        if not self.expect(call, answer, 200 if visible else 404, "reading a file") or not visible:
            return
        model = self.file_models[file]
        if part:
            self.check(answer.content == model.content, "the file's content changed", call)
        else:
            self.check(answer.body["bytes"] == len(model.content), "the file's size", call)

    @rule(asker=ASKER, file=files)
    def delete_file(self, asker: int, file: str) -> None:
        who = self.asking(asker, self.file_models[file].owner)
        visible = self.file_visible(file, who)
        call, answer = self.send("DELETE", f"/v1/files/{file}", who)
        self.dirty_keys.add(self.file_models[file].owner)
        if self.expect(call, answer, 200 if visible else 404, "deleting a file") and visible:
            self.check(answer.body["deleted"] is True, "a deletion not said to be", call)
            self.file_models[file].deleted = True

    @rule(
        who=WHO,
        purpose=st.sampled_from([None, "batch", "batch_output", "x"]),
        order=st.sampled_from(["desc", "asc", "ASC", ""]),
        limit=LIMIT,
        cursor=LIST_CURSOR,
    )
    def list_files(
        self, who: int, purpose: str | None, order: str, limit: int, cursor: Any
    ) -> None:
        """A page: the key's files only, in order; after one of its uploads, the slice of the
        full list after it; after anything else, empty."""
        who = self.who(who)
        own = [i for i, f in self.file_models.items() if f.owner == who and not f.deleted]
        after, is_own = self.list_cursor(cursor, who, own, "file-")
        params = [("order", order), ("limit", str(limit))]
        params += [(n, v) for n, v in (("purpose", purpose), ("after", after)) if v is not None]
        valid = order in ("asc", "desc") and 1 <= limit <= 10_000
        valid = valid and (after is None or len(after) <= MAX_ID_LENGTH)
        call, answer = self.send("GET", "/v1/files", who, params=params)
        if not self.expect(call, answer, 200 if valid else 400, "listing files") or not valid:
            return
        page = answer.body["data"]
        self.owned_visible(page, who, call)
        self.check(len(page) <= limit, "a page longer than its limit", call)
        self.check(all(purpose in (None, f["purpose"]) for f in page), "the purpose filter", call)
        times = [f["created_at"] for f in page]
        self.check(times == sorted(times, reverse=order == "desc"), "files out of order", call)
        if after is not None and purpose == "batch":  # only this machine's uploads change it
            full = [f["id"] for f in self.full_file_list(who, "batch", order)]
            rest = full[full.index(after) + 1 :] if is_own and after in full else []
            self.check(
                [f["id"] for f in page] == rest[:limit],
                f"the page after {after!r} is not the full list's slice after it ({rest[:limit]})",
                call,
            )

    @precondition(lambda self: any(not f.deleted for f in self.file_models.values()))
    @rule(who=WHO, limit=st.integers(1, 3))
    def page_through_files(self, who: int, limit: int) -> None:
        """Pages chained by ``after`` are the full list; ``asc`` is ``desc`` reversed."""
        who = self.who(who)
        chained = {}
        for order in ("desc", "asc"):
            chained[order], _ = self.chain(
                "/v1/files", who, [("purpose", "batch"), ("order", order)], limit, "after"
            )
            full = [f["id"] for f in self.full_file_list(who, "batch", order)]
            self.check(chained[order] == full, f"pages of files {chained[order]} != {full}")
        self.check(chained["asc"] == chained["desc"][::-1], "asc is not desc reversed")

    def chain(
        self, path: str, who: int, params: list[tuple[str, str]], limit: int, name: str,
        most: int = 50, enough: Callable[[list[str]], bool] = lambda ids: False,
    ) -> tuple[list[str], bool]:  # fmt: skip
        """The ids of up to ``most`` pages of ``limit``, each after the last id of the one
        before (``name``: the cursor's parameter), or of the pages until the ids are
        ``enough``; and whether the last page said it was the last."""
        ids: list[str] = []
        after: str | None = None
        for _ in range(most):
            if enough(ids):
                return ids, False
            cursor = [] if after is None else [(name, after)]
            call, answer = self.send(
                "GET", path, who, params=[*params, ("limit", str(limit)), *cursor]
            )
            if not self.expect(call, answer, 200, "listing a page"):
                return ids, False
            body = answer.body
            self.owned_visible(body["data"], who, call)
            ids += [item["id"] for item in body["data"]]
            if not body["has_more"]:
                return ids, True
            self.check(len(body["data"]) == limit, "a page short of its limit has more", call)
            after = body["last_id"]
            self.check(after == ids[-1], "last_id is not the page's last id", call)
        return ids, False

    # --- OpenAI batches ----------------------------------------------------------------------

    @precondition(lambda self: self.generations < GENERATIONS)
    @rule(
        targets=(batches, anything),
        asker=ASKER,
        file=files,
        endpoint=st.sampled_from(["its lines' url"] * 3 + [*BATCH_ENDPOINTS, "/v1/messages"]),
        window=st.sampled_from(["24h"] * 5 + ["1h"]),
    )
    def create_batch(self, asker: int, file: str, endpoint: str, window: str) -> Any:
        """Another key's file (or a deleted one) is a 404; a file that is not input for the
        endpoint makes a failed batch."""
        who = self.asking(asker, self.file_models[file].owner)
        self.generations += max(1, self.file_models[file].content.count(b"\n"))
        if endpoint == "its lines' url":
            endpoint = self.file_models[file].endpoint or BATCH_ENDPOINTS[0]
        body = {"input_file_id": file, "endpoint": endpoint, "completion_window": window}
        if endpoint not in BATCH_ENDPOINTS or window != "24h":
            expected = 400
        else:
            expected = 200 if self.file_visible(file, who) else 404
        call, answer = self.send("POST", "/v1/batches", who, body=body)
        if not self.expect(call, answer, expected, "creating a batch") or expected != 200:
            return self.ghost_batch(who, "openai")
        batch = answer.body
        valid = self.file_models[file].endpoint == endpoint
        self.check(
            batch["status"] == ("in_progress" if valid else "failed"),
            f"a batch of {'valid' if valid else 'invalid'} input is {batch['status']}",
            call,
        )
        lines = self.file_models[file].content.count(b"\n") if valid else 0
        self.check(batch["request_counts"]["total"] == lines, "the batch's total", call)
        model = BatchModel(batch["id"], who, "openai", [f"line-{n}" for n in range(lines)])
        self.batch_models[batch["id"]] = model
        self.note_batch_status(model, batch["status"], call)
        self.remember(batch["id"], who)
        self.run.owners[batch["id"].split("_", 1)[1]] = who  # its lines' jobs
        return batch["id"]

    @rule(asker=ASKER, batch=batches, cancel=st.booleans())
    def read_or_cancel_batch(self, asker: int, batch: str, cancel: bool) -> None:
        who = self.asking(asker, self.batch_models[batch].owner)
        visible = self.batch_visible(batch, who, "openai")
        method, path = (
            ("POST", f"/v1/batches/{batch}/cancel") if cancel else ("GET", f"/v1/batches/{batch}")
        )
        call, answer = self.send(method, path, who)
        if not self.expect(call, answer, 200 if visible else 404, "a batch") or not visible:
            return
        model, body = self.batch_models[batch], answer.body
        self.check(body["status"] in BATCH_STATUSES, f"an unknown status {body['status']!r}", call)
        counts = body["request_counts"]
        self.check(counts["total"] == len(model.custom_ids), f"the total of {counts}", call)
        ended = counts["completed"] + counts["failed"]
        self.check(ended <= counts["total"], f"more requests ended than asked: {counts}", call)
        if cancel and model.terminal is None:
            self.check(body["status"] in ("cancelling", *BATCH_TERMINAL), "not cancelling", call)
        self.note_batch_status(model, body["status"], call)
        if body["status"] in ("completed", "cancelled", "expired"):
            self.read_outputs(who, model, body, call)

    def read_outputs(self, who: int, model: BatchModel, batch: dict, batch_call: Call) -> None:
        """An ended batch's output and error files: its key's, holding each line once."""
        seen: list[str] = []
        for name in ("output_file_id", "error_file_id"):
            if batch[name] is None:
                continue
            self.run.owners[batch[name]] = model.owner
            for reader in range(self.keys):
                call, answer = self.send("GET", f"/v1/files/{batch[name]}/content", reader)
                mine = reader == who
                if self.expect(call, answer, 200 if mine else 404, "an output file") and mine:
                    seen += [json.loads(x)["custom_id"] for x in answer.content.splitlines()]
        self.check(
            sorted(seen) == sorted(model.custom_ids) or batch["status"] == "cancelled",
            f"the outputs of {model.id} hold {sorted(seen)}, not each line once",
            batch_call,
        )

    @rule(who=WHO, limit=LIMIT, cursor=LIST_CURSOR)
    def list_batches(self, who: int, limit: int, cursor: Any) -> None:
        who = self.who(who)
        own = [b.id for b in self.batch_models.values() if self.batch_visible(b.id, who, "openai")]
        after, is_own = self.list_cursor(cursor, who, own, "batch_")
        self.check_id_page("/v1/batches", who, limit, 100, "after", after, is_own)

    def check_id_page(
        self, path: str, who: int, limit: int, most: int, name: str, after: str | None,
        is_own: bool, params: list[tuple[str, str]] | None = None,
    ) -> list[dict[str, Any]] | None:  # fmt: skip
        """A page after ``after`` (``name``): the key's objects only; after one of its own
        ids the full list's slice after it, otherwise empty. The page, or None."""
        extra = params or []
        sent = [*extra, ("limit", str(limit)), *([] if after is None else [(name, after)])]
        valid = 1 <= limit <= most and (after is None or len(after) <= MAX_ID_LENGTH)
        call, answer = self.send("GET", path, who, params=sent)
        if not self.expect(call, answer, 200 if valid else 400, "listing") or not valid:
            return None
        page = answer.body["data"]
        self.owned_visible(page, who, call)
        self.check(len(page) <= limit, "a page longer than its limit", call)
        if after is not None:
            through = lambda ids: after in ids and len(ids) > ids.index(after) + limit  # noqa: E731
            full = self.all_ids(path, who, name, extra, through) if is_own else []
            rest = full[full.index(after) + 1 :] if after in full else []
            self.check(
                [item["id"] for item in page] == rest[:limit],
                f"the page after {after!r} is not the full list's slice after it "
                f"({rest[:limit]}): a cursor that is not the caller's own id gives an empty page",
                call,
            )
        return page

    def all_ids(
        self, path: str, who: int, name: str, params: list[tuple[str, str]],
        enough: Callable[[list[str]], bool] = lambda ids: False,
    ) -> list[str]:  # fmt: skip
        """The ids of the key's full list at ``path``, read in pages of 100 until it ends
        or they are ``enough``."""
        ids, complete = self.chain(path, who, params, 100, name, enough=enough)
        self.check(complete or enough(ids), f"{path} did not end within 50 pages of 100")
        return ids

    @precondition(lambda self: bool(self.batch_models))
    @rule(who=WHO, limit=st.integers(1, 3))
    def page_through_batches(self, who: int, limit: int) -> None:
        """Small pages chained by ``after`` start the full list (end it, when they reach the
        end); the model's batches are in it."""
        who = self.who(who)
        chained, complete = self.chain("/v1/batches", who, [], limit, "after", most=6)
        own = {b for b in self.batch_models if self.batch_visible(b, who, "openai")}
        full = self.all_ids(
            "/v1/batches", who, "after", [], lambda ids: len(ids) > len(chained) and own <= set(ids)
        )
        start = full if complete else full[: len(chained)]
        self.check(chained == start, f"pages of batches {chained} != the full list {full}")
        self.check(own <= set(full), f"batches missing from the list: {sorted(own - set(full))}")

    # --- Anthropic message batches ----------------------------------------------------------

    @precondition(lambda self: self.generations < GENERATIONS)
    @rule(
        targets=(message_batches, anything),
        who=WHO,
        count=st.integers(1, 3),
        tokens=TOKENS,
        twice=st.sampled_from([False, False, False, True]),
        broken=st.booleans(),
    )
    def create_message_batch(
        self, who: int, count: int, tokens: int, twice: bool, broken: bool
    ) -> Any:
        """A custom id used twice is a 400; a request the Messages route refuses errs alone."""
        who = self.who(who)
        self.generations += count
        body = generation_body("/v1/messages", tokens)
        requests = [{"custom_id": f"req-{n}", "params": body} for n in range(count)]
        if broken:
            requests[-1] = {**requests[-1], "params": {**body, "temperature": 7}}
        if twice:
            requests.append(requests[0])
        call, answer = self.send("POST", "/v1/messages/batches", who, body={"requests": requests})
        if not self.expect(call, answer, 400 if twice else 200, "a message batch") or twice:
            return self.ghost_batch(who, "anthropic")
        batch = answer.body
        self.check(batch["processing_status"] == "in_progress", "a new batch not in progress", call)
        custom_ids = [r["custom_id"] for r in requests]
        self.batch_models[batch["id"]] = BatchModel(batch["id"], who, "anthropic", custom_ids)
        self.remember(batch["id"], who)
        self.run.owners[batch["id"].split("_", 1)[1]] = who
        return batch["id"]

    @rule(
        asker=ASKER,
        batch=message_batches,
        action=st.sampled_from(["get", "cancel", "results", "delete"]),
    )
    def use_message_batch(self, asker: int, batch: str, action: str) -> None:
        """404 for another key's (or a deleted) batch; results and deletion once it ended."""
        who = self.asking(asker, self.batch_models[batch].owner)
        model = self.batch_models[batch]
        visible = self.batch_visible(batch, who, "anthropic")
        path = f"/v1/messages/batches/{batch}"
        method, path = {
            "get": ("GET", path), "cancel": ("POST", f"{path}/cancel"),
            "results": ("GET", f"{path}/results"), "delete": ("DELETE", path),
        }[action]  # fmt: skip
        if not visible:
            expected = {404}
        elif action in ("results", "delete"):
            expected = {200} if model.terminal == "ended" else {200, 400}
        else:
            expected = {200}
        call, answer = self.send(method, path, who)
        if not self.expect(call, answer, expected, f"{action} a message batch") or not visible:
            return
        if answer.status == 400:
            return  # not ended yet
        if action == "results":
            model.terminal = "ended"
            got = [json.loads(line)["custom_id"] for line in answer.content.splitlines()]
            self.check(got == model.custom_ids, f"results for {got}, not {model.custom_ids}", call)
        elif action == "delete":
            model.deleted, model.terminal = True, "ended"
        else:
            status = answer.body["processing_status"]
            self.check(status in ("in_progress", "canceling", "ended"), f"status {status}", call)
            self.note_batch_status(model, status, call)
            counts = answer.body["request_counts"]
            self.check(sum(counts.values()) == len(model.custom_ids), f"counts {counts}", call)

    @rule(
        who=WHO, limit=st.one_of(st.integers(1, 4), LIMIT), cursor=LIST_CURSOR,
        before=st.booleans(),
    )  # fmt: skip
    def list_message_batches(self, who: int, limit: int, cursor: Any, before: bool) -> None:
        """``after_id`` as any list cursor; ``before_id``: the page just newer than it."""
        who = self.who(who)
        batches = self.batch_models.values()
        own = [b.id for b in batches if self.batch_visible(b.id, who, "anthropic")]
        after, is_own = self.list_cursor(cursor, who, own, "msgbatch_")
        path = "/v1/messages/batches"
        if not before:
            self.check_id_page(path, who, limit, 1000, "after_id", after, is_own)
            return
        params = [("limit", str(limit))] + ([] if after is None else [("before_id", after)])
        valid = 1 <= limit <= 1000 and (after is None or len(after) <= MAX_ID_LENGTH)
        call, answer = self.send("GET", path, who, params=params)
        if not self.expect(call, answer, 200 if valid else 400, "listing before") or not valid:
            return
        page = [item["id"] for item in answer.body["data"]]
        self.owned_visible(answer.body["data"], who, call)
        full = self.all_ids(path, who, "after_id", [])
        gone = {b.id for b in batches if b.owner == who and b.deleted}
        self.check(set(own) <= set(full), f"batches missing from the list: {set(own) - set(full)}")
        self.check(not gone & set(full), f"deleted batches in the list: {gone & set(full)}")
        if after is None:
            expected = full[:limit]
        elif is_own and after in full:
            at = full.index(after)
            expected = full[max(0, at - limit) : at]
        else:
            expected = []
        self.check(page == expected, f"the page before {after!r} is not {expected}", call)

    # --- responses ---------------------------------------------------------------------------

    @precondition(lambda self: self.generations < GENERATIONS)
    @rule(
        targets=(responses, jobs, anything),
        who=WHO,
        tokens=TOKENS,
        background=st.booleans(),
        store=st.sampled_from([None, True, False]),
        stream=st.booleans(),
    )
    def create_response(
        self, who: int, tokens: int, background: bool, store: bool | None, stream: bool
    ) -> Any:
        """A background response must be stored; a foreground one with store false is
        kept nowhere."""
        return self.respond(self.who(who), tokens, background, store, stream, None)

    @precondition(lambda self: self.generations < GENERATIONS)
    @rule(
        targets=(responses, jobs, anything),
        asker=ASKER,
        previous=responses,
        tokens=TOKENS,
        background=st.booleans(),
        stream=st.booleans(),
    )
    def continue_response(
        self, asker: int, previous: str, tokens: int, background: bool, stream: bool
    ) -> Any:
        """Continuing another key's (a deleted, an unstored) response is a 404; one that has not
        finished, a 400."""
        return self.respond(
            self.asking(asker, self.job_models[previous].owner),
            tokens,
            background,
            None,
            stream,
            previous,
        )

    def respond(
        self, who: int, tokens: int, background: bool, store: bool | None, stream: bool,
        previous: str | None,
    ) -> Any:  # fmt: skip
        self.generations += 1
        body: dict[str, Any] = generation_body("/v1/responses", tokens)
        stream = stream and not background
        body.update(background=background, stream=stream)
        if store is not None:
            body["store"] = store
        expected = {400} if background and store is False else {200}
        if previous is not None and expected == {200}:
            expected = self.continuing(who, previous)
            body["previous_response_id"] = self.job_models[previous].response_id
        call, answer = self.send("POST", "/v1/responses", who, body=body)
        if not self.expect(call, answer, expected, "creating a response") or answer.status != 200:
            return self.ghost_job(who, "/v1/responses")
        if stream:
            done = [
                e
                for e in answer.events or []
                if e.event in ("response.completed", "response.incomplete")
            ]
            self.check(len(done) == 1, "a stream that does not end its response once", call)
            response = json.loads(done[0].data)["response"]
        else:
            response = answer.body
        job_id = "job_" + response["id"].removeprefix("resp_")
        stored = store is not False
        model = JobModel(
            job_id, who, "/v1/responses", is_job=stored, is_response=stored,
            background=background, pending=stream and stored,
        )  # fmt: skip
        if stored and not background:
            model.terminal = "completed"
        self.job_models[job_id] = model
        self.remember(job_id, who)
        self.remember(model.response_id, who)
        self.note_response_status(model, response["status"], call)
        return job_id

    def continuing(self, who: int, previous: str) -> set[int]:
        """What continuing ``previous`` may answer: 404 unless it is the key's stored
        response; 400 while it has not completed."""
        model = self.job_models[previous]
        if not self.response_visible(previous, who):
            return {404}
        if model.pending:
            return {200, 404}
        if model.terminal is None:
            return {200, 400}
        return {200} if model.terminal == "completed" else {400}

    @rule(asker=ASKER, response=responses, stream=st.booleans(), cursor=EVENT_CURSOR)
    def read_response(self, asker: int, response: str, stream: bool, cursor: str | None) -> None:
        """Another key's is a 404; only a background one streams again, from after
        ``starting_after``."""
        who = self.asking(asker, self.job_models[response].owner)
        model = self.job_models[response]
        params = [("stream", "true")] if stream else []
        params += [] if cursor is None or not stream else [("starting_after", cursor)]
        visible = self.response_visible(response, who)
        expected = self.found(response, who, visible)
        if visible and stream and not (model.background and event_cursor_ok(cursor)):
            expected = expected - {200} | {400}
        call, answer = self.send("GET", f"/v1/responses/{model.response_id}", who, params=params)
        if not self.expect(call, answer, expected, "reading a response") or answer.status != 200:
            return
        model.pending = False
        if not stream:
            self.check(answer.body["id"] == model.response_id, "another response's id", call)
            self.note_response_status(model, answer.body["status"], call)
            return
        first = -1 if not cursor else int(cursor)  # an empty cursor is no cursor
        self.check_sequence(answer.events or [], first, call)
        for event in answer.events or []:
            number = json.loads(event.data).get("sequence_number")
            self.check(str(number) == event.id, f"event {event.id} says {number}", call)

    def check_sequence(self, events: list[Event], after: int, call: Call) -> None:
        """Events numbered ``after + 1``, ``after + 2``...: a stream resumed after ``after``."""
        ids = [event.id for event in events]
        expected = [str(n) for n in range(after + 1, after + 1 + len(ids))]
        self.check(ids == expected, f"event ids {ids} after {after}, expected {expected}", call)

    @rule(asker=ASKER, response=responses, delete=st.booleans())
    def cancel_or_delete_response(self, asker: int, response: str, delete: bool) -> None:
        """Another key's is a 404; only a background response is cancelled, and a cancelled
        one has ended; a deleted one is gone, its job with it."""
        who = self.asking(asker, self.job_models[response].owner)
        model = self.job_models[response]
        visible = self.response_visible(response, who)
        expected = self.found(response, who, visible)
        if visible and not delete and not model.background:
            expected = expected - {200} | {400}
        path = f"/v1/responses/{model.response_id}"
        call, answer = self.send(*(("DELETE", path) if delete else ("POST", f"{path}/cancel")), who)
        if not self.expect(call, answer, expected, "cancelling or deleting a response"):
            return
        if answer.status != 200:
            return
        model.pending = False
        if delete:
            self.check(answer.body.get("deleted") is True, "a deletion not said to be", call)
            model.deleted = True
            return
        status = answer.body["status"]
        self.check(status in RESPONSE_TERMINAL, f"a cancelled response is {status}", call)
        self.note_response_status(model, status, call)

    @rule(
        asker=ASKER,
        response=responses,
        order=st.sampled_from(["asc", "desc", "up"]),
        limit=LIMIT,
        cursor=LIST_CURSOR,
    )
    def list_input_items(
        self, asker: int, response: str, order: str, limit: int, cursor: Any
    ) -> None:
        """Another key's response is a 404; the items of one's own are listed, and none
        after a cursor that is not one of them."""
        who = self.asking(asker, self.job_models[response].owner)
        model = self.job_models[response]
        path = f"/v1/responses/{model.response_id}/input_items"
        after, _ = self.list_cursor(cursor, who, [], "msg_")
        params = [("order", order), ("limit", str(limit))]
        params += [] if after is None else [("after", after)]
        too_long = after is not None and len(after) > MAX_ID_LENGTH
        if too_long or not (1 <= limit <= 100 and order in ("asc", "desc")):
            expected = {400}
        else:
            expected = self.found(response, who, self.response_visible(response, who))
        call, answer = self.send("GET", path, who, params=params)
        if not self.expect(call, answer, expected, "input items") or answer.status != 200:
            return
        model.pending = False
        items = answer.body["data"]
        self.check(after is None or items == [], f"items after a foreign cursor {after!r}", call)
        self.check(len(items) <= limit and bool(items) == (after is None), "the page", call)

    # --- jobs --------------------------------------------------------------------------------

    @precondition(lambda self: self.generations < GENERATIONS)
    @rule(targets=(jobs, anything), who=WHO, endpoint=st.sampled_from(JOB_ENDPOINTS), tokens=TOKENS)
    def submit_job(self, who: int, endpoint: str, tokens: int) -> Any:
        who = self.who(who)
        self.generations += 1
        job = {"endpoint": endpoint, "body": generation_body(endpoint, tokens)}
        call, answer = self.send("POST", "/v1/jobs", who, body=job)
        if not self.expect(call, answer, 202, "submitting a job"):
            return self.ghost_job(who, endpoint)
        return self.note_job(answer.body, who, endpoint, call)

    @precondition(lambda self: self.generations < GENERATIONS)
    @rule(
        targets=(jobs, responses, anything),
        who=WHO,
        tokens=TOKENS,
        store=st.sampled_from([None, True, False]),
    )
    def submit_response_job(self, who: int, tokens: int, store: bool | None) -> Any:
        """A job of ``/v1/responses`` is a stored response too, unless its body says store
        false."""
        who = self.who(who)
        self.generations += 1
        body = generation_body("/v1/responses", tokens)
        if store is not None:
            body["store"] = store
        call, answer = self.send(
            "POST", "/v1/jobs", who, body={"endpoint": "/v1/responses", "body": body}
        )
        if not self.expect(call, answer, 202, "submitting a job"):
            return self.ghost_job(who, "/v1/responses")
        job_id = self.note_job(answer.body, who, "/v1/responses", call)
        self.job_models[job_id].is_response = store is not False
        self.remember(self.job_models[job_id].response_id, who)
        return job_id

    @precondition(lambda self: self.generations < GENERATIONS)
    @rule(
        targets=(jobs, anything),
        who=WHO,
        endpoints=st.lists(st.sampled_from(JOB_ENDPOINTS), min_size=1, max_size=3),
        bare=st.booleans(),
        tokens=TOKENS,
    )
    def submit_jobs(self, who: int, endpoints: list[str], bare: bool, tokens: int) -> Any:
        who = self.who(who)
        self.generations += len(endpoints)
        items = [{"endpoint": e, "body": generation_body(e, tokens)} for e in endpoints]
        call, answer = self.send(
            "POST", "/v1/jobs/batch", who, body=items if bare else {"jobs": items}
        )
        if not self.expect(call, answer, 202, "submitting jobs"):
            return multiple(*(self.ghost_job(who, endpoint) for endpoint in endpoints))
        data = answer.body["data"]
        self.check([j["endpoint"] for j in data] == endpoints, "the jobs' order", call)
        return multiple(*(self.note_job(j, who, j["endpoint"], call) for j in data))

    def note_job(self, job: dict[str, Any], who: int, endpoint: str, call: Call) -> str:
        model = JobModel(job["id"], who, endpoint)
        self.job_models[job["id"]] = model
        self.remember(job["id"], who)
        self.note_job_status(model, job["status"], call)
        return job["id"]

    @rule(asker=ASKER, job=jobs, cancel=st.booleans())
    def read_or_cancel_job(self, asker: int, job: str, cancel: bool) -> None:
        """Another key's job is a 404; a cancelled one has ended."""
        who = self.asking(asker, self.job_models[job].owner)
        expected = self.found(job, who, self.job_visible(job, who))
        call, answer = self.send("DELETE" if cancel else "GET", f"/v1/jobs/{job}", who)
        if not self.expect(call, answer, expected, "a job") or answer.status != 200:
            return
        model, body = self.job_models[job], answer.body
        model.pending = False
        self.check(body["id"] == job, "another job's id", call)
        if cancel:
            self.check(body["status"] in JOB_TERMINAL, f"a cancelled job is {body['status']}", call)
        self.note_job_status(model, body["status"], call)
        error = body.get("error") or {}
        overloaded = error.get("status") == 503 and error.get("retry_after") is not None
        self.check(error.get("status", 0) < 500 or overloaded, f"the job failed: {error}", call)

    @rule(asker=ASKER, job=jobs, after=EVENT_CURSOR, last_event_id=EVENT_CURSOR)
    def read_job_events(
        self, asker: int, job: str, after: str | None, last_event_id: str | None
    ) -> None:
        """Any cursor but a whole number from 0 is a 400; another key's job a 404; the stream
        resumes after the cursor (``Last-Event-ID`` before ``after``)."""
        who = self.asking(asker, self.job_models[job].owner)
        model = self.job_models[job]
        headers: dict[str, str | bytes] = {}
        cursor = after
        if last_event_id is not None:
            raw = header_value(last_event_id)
            headers["last-event-id"] = raw
            cursor = raw.decode("latin-1")
        params = [] if after is None else [("after", after)]
        if not event_cursor_ok(cursor):
            expected = {400}
        else:
            expected = self.found(job, who, self.job_visible(job, who))
        call, answer = self.send(
            "GET", f"/v1/jobs/{job}/events", who, params=params, headers=headers
        )
        if not self.expect(call, answer, expected, "a job's events") or answer.status != 200:
            return
        model.pending = False
        self.check_sequence(answer.events or [], int(cursor or 0), call)

    @rule(
        who=WHO,
        status=st.sampled_from([None, None, "queued", "completed", "cancelled", "done"]),
        limit=LIMIT,
        cursor=LIST_CURSOR,
    )
    def list_jobs(self, who: int, status: str | None, limit: int, cursor: Any) -> None:
        """The key's jobs only, with the status asked for; pages by any cursor."""
        who = self.who(who)
        own = [j for j in self.job_models if self.job_visible(j, who)]
        after, is_own = self.list_cursor(cursor, who, own, "job_")
        if status is not None:
            valid = status in JOB_STATUSES and 1 <= limit <= 100
            valid = valid and (after is None or len(after) <= MAX_ID_LENGTH)
            params = [("status", status), ("limit", str(limit))]
            params += [] if after is None else [("after", after)]
            call, answer = self.send("GET", "/v1/jobs", who, params=params)
            if self.expect(call, answer, 200 if valid else 400, "listing jobs") and valid:
                page = answer.body["data"]
                self.owned_visible(page, who, call)
                self.check(all(j["status"] == status for j in page), "the status filter", call)
            return
        self.check_id_page("/v1/jobs", who, limit, 100, "after", after, is_own)

    @precondition(lambda self: bool(self.job_models))
    @rule(who=WHO)
    def audit_jobs(self, who: int) -> None:
        """The key's full list of jobs holds its live jobs, none of its deleted ones."""
        who = self.who(who)
        live = {j for j, m in self.job_models.items() if self.job_visible(j, who) and not m.pending}
        listed = set(self.all_ids("/v1/jobs", who, "after", [], lambda ids: live <= set(ids)))
        for model in self.job_models.values():
            if model.owner != who or not model.is_job or model.pending:
                continue
            self.check(
                (model.job_id in listed) != model.deleted,
                f"{model.job_id} ({'deleted' if model.deleted else 'live'}) is "
                f"{'' if model.job_id in listed else 'not '}in key {KEY_NAMES[who]}'s jobs",
            )

    # --- ids of other kinds, unknown keys ---------------------------------------------------------

    @rule(asker=ASKER, thing=anything, route=st.integers(0, 9))
    def ids_in_the_wrong_place(self, asker: int, thing: str, route: int) -> None:
        """An id used where another kind's id goes is a 404, whoever asks."""
        who = self.asking(asker, self.run.owner_of(thing) or 0)
        kind = "file" if thing.startswith("file-") else thing.split("_", 1)[0]
        routes = [
            ("file", "GET", "/v1/files/{}"), ("file", "GET", "/v1/files/{}/content"),
            ("file", "DELETE", "/v1/files/{}"), ("batch", "GET", "/v1/batches/{}"),
            ("batch", "POST", "/v1/batches/{}/cancel"),
            ("msgbatch", "GET", "/v1/messages/batches/{}"),
            ("msgbatch", "GET", "/v1/messages/batches/{}/results"),
            ("msgbatch", "DELETE", "/v1/messages/batches/{}"), ("job", "GET", "/v1/jobs/{}"),
            ("job", "DELETE", "/v1/jobs/{}"), ("job", "GET", "/v1/jobs/{}/events"),
        ]  # fmt: skip
        others = [r for r in routes if r[0] != kind]
        _, method, path = others[route % len(others)]
        call, answer = self.send(method, path.format(thing), who)
        self.expect(call, answer, 404, "an id of another kind")

    @rule(
        thing=anything,
        route=st.sampled_from(
            [
                ("GET", "/v1/files/{}"), ("GET", "/v1/files"), ("DELETE", "/v1/files/{}"),
                ("GET", "/v1/batches/{}"), ("GET", "/v1/batches"), ("GET", "/v1/jobs"),
                ("GET", "/v1/jobs/{}"), ("DELETE", "/v1/jobs/{}"), ("GET", "/v1/jobs/{}/events"),
                ("GET", "/v1/messages/batches"), ("DELETE", "/v1/messages/batches/{}"),
                ("GET", "/v1/responses/{}"), ("POST", "/v1/responses/{}/cancel"),
            ]
        ),
    )  # fmt: skip
    def an_unknown_key(self, thing: str, route: tuple[str, str]) -> None:
        """A key the server does not know gets a 401 on every route, whatever the id."""
        method, path = route
        if path.startswith("/v1/responses"):
            thing = "resp_" + thing.split("_", 1)[-1]
        call, answer = self.send(method, path.format(thing), -1)
        self.expect(call, answer, 401, "an unknown key")


def run_sequences(target: Target, examples: int, steps: int, mode: str) -> None:
    """Run the machine against ``target`` (``examples`` sequences of ``steps`` steps, times
    ``SLUICE_FUZZ_SCALE``) while ``/health`` is polled; print what it took; raise what
    fails."""
    started = time.monotonic()
    with HealthPoller(target.base_url) as poller:
        run = Run(target, Wire(target), poller)
        try:
            run_state_machine_as_test(
                lambda: SequenceMachine(run), settings=fuzz_settings(examples, steps)
            )
        finally:
            run.wire.close()
            print(
                f"\n{mode}: {run.sequences} sequences, {run.steps} steps, {run.wire.calls} calls "
                f"in {time.monotonic() - started:.1f}s; {poller.summary()}"
            )
    assert not poller.problems, f"/health: {poller.problems[:10]}"
    assert run.undrained is None, run.undrained


__all__ = [
    "HEALTH_LIMIT_S",
    "HealthPoller",
    "SequenceMachine",
    "Target",
    "run_sequences",
    "server_options",
]
