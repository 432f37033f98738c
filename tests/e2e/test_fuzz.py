"""Fuzzing every route of a real server: no input is answered with a 5xx, none hangs.

Hypothesis draws the inputs: any JSON value as a body; a valid body of each
route with one field (at any depth) replaced by a value of the wrong type or
removed; any code point a JSON string can encode (lone surrogates and control
characters included) in each string of a valid body and as a field name;
truncated and non-JSON bodies; wrong content types; odd query parameters, job
ids, cursors and header values. Every answer must be below 500 (a 503 with
``Retry-After``, the answer to overload, is the one exception) and come within
``TIMEOUT_S``; neither a stream nor a job may end in a server error.

Generation stays cheap: every valid body asks for one token, and a body whose
mutated field is a length field (``max_tokens``...) is sent as a stream that is
hung up on after its first event, or as a job cancelled at once, so the server
cancels whatever it started. Other jobs are followed to their end and their
event stream is replayed. The last test checks that the server still answers a
plain chat request and prints the server's resident memory before and after the
fuzzing, when its process can be found.

``SLUICE_FUZZ_SCALE=10`` draws ten times as many examples, for a deeper search.
"""

from __future__ import annotations

import copy
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, quote_from_bytes

import httpx
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from tests.servers import rss_mib, server_pid

pytestmark = pytest.mark.slow

TIMEOUT_S = 30
STREAM_READ_BYTES = 64 * 2**10
LONG_TEXT = "x" * 200_000
# JSON strings of escapes: a surrogate pair (U+1F600), controls, a BOM, U+FFFF, U+2028;
# lone high and low surrogates.
ESCAPES = [
    '"\\ud83d\\ude00 \\u0000\\u001f\\u007f\\ufeff\\uffff\\u2028\\r\\n"',
    '"\\ud800 \\udfff \\ude00\\ud83d"',
]
# Fields that decide how long a request generates; one of them mutated is cut short.
LENGTH_FIELDS = {"max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens"}

# --- valid bodies -----------------------------------------------------------------------

PARAMETERS = {"type": "object", "properties": {"zone": {"type": "string"}}}
SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "string", "maxLength": 5},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["a"],
    "additionalProperties": False,
}

CHAT = {
    "model": "default",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": [{"type": "text", "text": "Answer plainly."}]},
        {"role": "user", "content": [{"type": "text", "text": "What time is it?"}], "name": "ann"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "Use the tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "now", "arguments": '{"zone": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "noon", "name": "now"},
        {"role": "user", "content": "Thanks."},
    ],
    "max_tokens": 1,
    "max_completion_tokens": 1,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.0,
    "seed": 1,
    "presence_penalty": 0.1,
    "frequency_penalty": 0.1,
    "repetition_penalty": 1.1,
    "stop": ["\n\n"],
    "n": 1,
    "stream": False,
    "stream_options": {"include_usage": True},
    "logprobs": True,
    "top_logprobs": 1,
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "now",
                "description": "The time.",
                "parameters": PARAMETERS,
                "strict": False,
            },
        }
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "response_format": {"type": "text"},
    "user": "ann",
    "metadata": {"k": "v"},
    "priority": 0,
    "skip_special_tokens": True,
    "stop_token_ids": [2],
    "min_tokens": 0,
    "ignore_eos": False,
    "logit_bias": {"42": 1},
    "continue_final_message": False,
    "chat_template_kwargs": {"enable_thinking": False},
}
SHORT_CHAT = {
    "model": "default",
    "messages": [{"role": "user", "content": "Reply in JSON."}],
    "max_tokens": 1,
}

RESPONSES = {
    "model": "default",
    "instructions": "Be brief.",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What time is it?"}]},
        {"type": "function_call", "call_id": "c1", "name": "now", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "noon"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "."}]},
        {"type": "message", "role": "user", "content": "Thanks."},
    ],
    "max_output_tokens": 1,
    "temperature": 0.5,
    "top_p": 0.9,
    "tools": [
        {"type": "function", "name": "now", "description": "The time.", "parameters": PARAMETERS}
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "text": {"format": {"type": "text"}},
    "include": ["message.output_text.logprobs"],
    "top_logprobs": 1,
    "metadata": {"k": "v"},
    "user": "ann",
    "store": False,
    "stream": False,
    "prompt_cache_key": "k",
    "safety_identifier": "s",
}

MESSAGES = {
    "model": "default",
    "max_tokens": 1,
    "system": "Be brief.",
    "messages": [
        {"role": "user", "content": "What time is it?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": ""},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "now", "input": {"zone": "UTC"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "noon", "is_error": False},
                {"type": "text", "text": "Thanks."},
            ],
        },
    ],
    "tools": [{"name": "now", "description": "The time.", "input_schema": PARAMETERS}],
    "tool_choice": {"type": "auto"},
    "stop_sequences": ["\n\n"],
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "metadata": {"user_id": "ann"},
    "stream": False,
}
COUNT_TOKENS = {
    key: MESSAGES[key] for key in ("model", "system", "messages", "tools", "tool_choice")
}


@dataclass(frozen=True, slots=True)
class Route:
    """A POST route and a valid body for it; ``generates``: the body produces tokens."""

    path: str
    body: Any
    generates: bool = False


ROUTES: dict[str, Route] = {
    "chat": Route("/v1/chat/completions", CHAT, generates=True),
    "chat json_schema": Route(
        "/v1/chat/completions",
        {
            **SHORT_CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "answer", "strict": True, "schema": SCHEMA},
            },
        },
        generates=True,
    ),
    "chat structured_outputs": Route(
        "/v1/chat/completions",
        {**SHORT_CHAT, "structured_outputs": {"regex": "[a-z]{1,3}"}},
        generates=True,
    ),
    "chat grammar": Route(
        "/v1/chat/completions",
        {**SHORT_CHAT, "structured_outputs": {"grammar": 'start: "yes" | "no"'}},
        generates=True,
    ),
    "chat forced tool": Route(
        "/v1/chat/completions",
        {
            **SHORT_CHAT,
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": SCHEMA, "strict": True},
                }
            ],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        generates=True,
    ),
    "responses": Route("/v1/responses", RESPONSES, generates=True),
    "responses json_schema": Route(
        "/v1/responses",
        {
            "model": "default",
            "input": "Reply in JSON.",
            "max_output_tokens": 1,
            "text": {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}},
        },
        generates=True,
    ),
    "messages": Route("/v1/messages", MESSAGES, generates=True),
    "messages json_schema": Route(
        "/v1/messages",
        {
            **SHORT_CHAT,
            "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
            "tools": [{"name": "f", "input_schema": SCHEMA, "strict": True}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        },
        generates=True,
    ),
    "count_tokens": Route("/v1/messages/count_tokens", COUNT_TOKENS),
    "tokenize": Route("/v1/tokenize", CHAT),
    "job": Route(
        "/v1/jobs",
        {"endpoint": "/v1/chat/completions", "body": SHORT_CHAT, "metadata": {"k": "v"}},
    ),
    "job responses": Route("/v1/jobs", {"endpoint": "/v1/responses", "body": RESPONSES}),
    "batch": Route(
        "/v1/jobs/batch",
        {"jobs": [{"endpoint": "/v1/messages", "body": MESSAGES, "metadata": {"k": "v"}}]},
    ),
    "bare batch": Route("/v1/jobs/batch", [{"endpoint": "/v1/chat/completions", "body": CHAT}]),
}
POST_PATHS = sorted({route.path for route in ROUTES.values()})
GET_PATHS = ["/v1/models", "/health", "/ready", "/metrics", "/v1/jobs"]


# --- strategies -------------------------------------------------------------------------


def paths_of(value: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """The path (keys and indexes) to every value inside ``value``, the root excluded."""
    if not isinstance(value, (dict, list)):
        return
    children = value.items() if isinstance(value, dict) else enumerate(value)
    for key, child in children:
        yield (*prefix, key)
        yield from paths_of(child, (*prefix, key))


def lookup(value: Any, path: tuple) -> Any:
    for key in path:
        value = value[key]
    return value


# Every field of every valid body, as (route name, path): the mutation points.
FIELDS = [(name, path) for name, route in ROUTES.items() for path in paths_of(route.body)]


def _fields_holding(kind: type) -> list[tuple[str, tuple]]:
    return [
        (name, path) for name, path in FIELDS if isinstance(lookup(ROUTES[name].body, path), kind)
    ]


STRINGS = _fields_holding(str)
OBJECTS = [(name, ()) for name, route in ROUTES.items() if isinstance(route.body, dict)]
OBJECTS += _fields_holding(dict)
KNOWN_KEYS = sorted({str(path[-1]) for _, path in FIELDS} | {"jobs", "endpoint", "body"})

# Any code point, lone surrogates included: they reach the server as \ud800-style escapes.
ANY_CHARACTER = st.one_of(
    st.characters(codec="utf-8"),
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
    st.characters(max_codepoint=0x1F),
    st.sampled_from(["\ufeff", "\uffff", "\u2028", "\x7f", '"', "\\", "\U0010ffff"]),
)
ANY_TEXT = st.text(ANY_CHARACTER, max_size=40)

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    ANY_TEXT,
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(KNOWN_KEYS) | ANY_TEXT, children, max_size=4)
    ),
    max_leaves=16,
)

WRONG_VALUES = st.one_of(
    st.sampled_from(
        [
            None,
            True,
            False,
            0,
            -1,
            1,
            2,
            2**31,
            2**63,
            -(2**63) - 1,
            2**64,
            10**30,
            -(10**30),
            10**400,
            1e308,
            -1e308,
            1e-300,
            5e-324,
            0.5,
            -0.0,
            "",
            "1",
            "default",
            "auto",
            "text",
            "user",
            "function",
            LONG_TEXT,
            [],
            {},
            [None],
            [""],
            [1],
            [[[]]],
            {"type": None},
            {"a": {"b": [{}]}},
        ]
    ),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    ANY_TEXT,
    JSON_VALUES,
)
REMOVE = "<remove the field>"  # a mutation that deletes the field


def replaced(body: Any, path: tuple, new: Any) -> Any:
    """A copy of ``body`` with the value at ``path`` set to ``new`` (or removed: ``REMOVE``)."""
    body = copy.deepcopy(body)
    parent = lookup(body, path[:-1])
    if new is REMOVE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return body


def encoded(body: Any, ascii_only: bool = True) -> bytes:
    """JSON bytes; without ``ascii_only``, a lone surrogate is written raw (invalid UTF-8)."""
    return json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def header_bytes(raw: bytes) -> bytes:
    """``raw`` made legal as a header value on the wire: no NUL, CR, LF, no edge whitespace."""
    return re.sub(rb"[\x00\r\n\x0b\x0c]", b"", raw).strip(b" \t")


# --- sending, checking, cleaning up -----------------------------------------------------

# The error types a 5xx carries, in a stream or a failed job: the three protocols' spellings.
SERVER_ERROR = re.compile(r'"(api_error|server_error|timeout_error)"')


@dataclass(slots=True)
class Call:
    """One request; ``str()`` is a curl line that reproduces it (``BASE``: the server's URL).

    ``cut_short``: read a stream's first event only, then hang up (the server
    cancels the generation); cancel a queued job at once rather than let it run.
    """

    method: str
    url: str
    content: bytes | None = None
    headers: dict[str, str | bytes] = field(default_factory=dict)
    cut_short: bool = False

    def __str__(self) -> str:
        headers = "".join(f" -H {f'{name}: {value!r}'!r}" for name, value in self.headers.items())
        body = "" if self.content is None else f" --data-binary {_shown(self.content)}"
        return f"curl -X {self.method} 'BASE{self.url}'{headers}{body}"


def _shown(content: bytes) -> str:
    text = repr(content)
    return text if len(text) <= 2000 else f"{text[:1000]}...({len(content)} bytes)...{text[-500:]}"


@dataclass(slots=True)
class Answer:
    status: int
    headers: httpx.Headers
    text: str


def send(http: httpx.Client, call: Call) -> Answer:
    """Send ``call`` and check the answer: below 500, in time, no server error in a stream.

    A job it queues is followed to its end (or cancelled, with ``cut_short``),
    and must not end in a server error either.
    """
    started = time.monotonic()
    try:
        answer = _exchange(http, call)
    except httpx.TimeoutException:
        pytest.fail(f"no answer within {TIMEOUT_S}s (a hang): {call}")
    except httpx.TransportError as exc:
        pytest.fail(f"the connection failed ({exc!r}): {call}")
    elapsed = time.monotonic() - started
    assert elapsed < TIMEOUT_S, f"answered after {elapsed:.1f}s: {call}"
    overloaded = answer.status == 503 and "retry-after" in answer.headers
    assert answer.status < 500 or overloaded, f"{answer.status} {answer.text[:2000]}\n{call}"
    if answer.status == 200 and "text/event-stream" in answer.headers.get("content-type", ""):
        assert not SERVER_ERROR.search(answer.text), f"{answer.text[:2000]}\n{call}"
    if answer.status == 202:
        for job_id in _queued_jobs(answer):
            _settle(http, job_id, call)
    return answer


def _exchange(http: httpx.Client, call: Call) -> Answer:
    with http.stream(
        call.method, call.url, content=call.content, headers=call.headers, timeout=TIMEOUT_S
    ) as response:
        read = b""
        for chunk in response.iter_bytes():
            read += chunk
            if call.cut_short and (b"\n\n" in read or len(read) > STREAM_READ_BYTES):
                break  # leaving the block hangs up: the server cancels the generation
        return Answer(response.status_code, response.headers, read.decode("utf-8", "replace"))


def _queued_jobs(answer: Answer) -> list[str]:
    body = json.loads(answer.text)
    jobs = body["data"] if body.get("object") == "list" else [body]
    return [job["id"] for job in jobs]


def _settle(http: httpx.Client, job_id: str, submitted: Call) -> None:
    """Cancel the job (``cut_short``) or wait for its end; then replay its whole stream."""
    if submitted.cut_short:
        send(http, Call("DELETE", f"/v1/jobs/{job_id}"))
    deadline = time.monotonic() + TIMEOUT_S
    job = json.loads(send(http, Call("GET", f"/v1/jobs/{job_id}")).text)
    while job["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, f"the job did not end in {TIMEOUT_S}s: {submitted}"
        time.sleep(0.05)
        job = json.loads(send(http, Call("GET", f"/v1/jobs/{job_id}")).text)
    error = job["error"] or {}
    assert error.get("status", 0) < 500, f"the job failed: {error}\n{submitted}"
    send(http, Call("GET", f"/v1/jobs/{job_id}/events"))


def post(path: str, body: bytes, *, cut_short: bool = False, **headers: str | bytes) -> Call:
    return Call("POST", path, body, {"content-type": "application/json", **headers}, cut_short)


def prepared(
    route: Route, body: Any, mutated: tuple, stream: bool, ascii_only: bool = True
) -> Call:
    """The call for ``body``, a stream when ``stream``; cut short past a mutated length field.

    Every other field leaves the valid body's single token in force.
    """
    long = bool(mutated) and mutated[-1] in LENGTH_FIELDS
    if route.generates and isinstance(body, dict) and (stream or long) and mutated != ("stream",):
        body = {**body, "stream": True}
    return post(route.path, encoded(body, ascii_only), cut_short=long)


# --- fixtures -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def memory(server: str) -> dict[str, Any]:
    """The server's pid and its resident memory before the first fuzz test."""
    pid = server_pid(server)
    return {"pid": pid, "before": rss_mib(pid)}


@pytest.fixture(scope="module")
def finished_job(http: httpx.Client, memory: dict[str, Any]) -> str:
    """The id of a job that ran to the end: its event stream has every event."""
    body = {**CHAT, "max_tokens": 2, "max_completion_tokens": 2}
    job = http.post("/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": body}).json()
    deadline = time.monotonic() + TIMEOUT_S
    while http.get(f"/v1/jobs/{job['id']}").json()["status"] != "completed":
        assert time.monotonic() < deadline, f"the job did not complete: {job}"
        time.sleep(0.1)
    return job["id"]


def fuzz(examples: int) -> settings:
    """Settings for a fuzz test: ``examples`` of them (times ``SLUICE_FUZZ_SCALE``), no deadline."""
    return settings(
        max_examples=examples * int(os.environ.get("SLUICE_FUZZ_SCALE", "1")),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# --- the fuzz tests ---------------------------------------------------------------------


def test_the_valid_bodies_are_valid(http: httpx.Client, memory: dict[str, Any]):
    """The bodies the mutations start from are accepted, so a mutation is what a 400 is about."""
    for name, route in ROUTES.items():
        answer = send(http, post(route.path, encoded(route.body)))
        assert answer.status in (200, 202), f"{name}: {answer.text}"
        assert "sluice-ignored-fields" not in answer.headers, name


@fuzz(120)
@given(path=st.sampled_from(POST_PATHS), body=JSON_VALUES)
@example(path="/v1/jobs", body={"endpoint": [], "body": {}})
@example(path="/v1/jobs/batch", body=[{"endpoint": {}, "body": {}}])
@example(path="/v1/jobs/batch", body={"jobs": [None]})
@example(path="/v1/jobs", body={"endpoint": "/v1/jobs", "body": {}})
def test_any_json_value_as_a_body(http: httpx.Client, path: str, body: Any):
    send(http, post(path, encoded(body)))


@fuzz(250)
@given(point=st.sampled_from(FIELDS), value=WRONG_VALUES | st.just(REMOVE), stream=st.booleans())
@example(point=("chat", ("temperature",)), value=10**400, stream=False)
@example(point=("chat", ("temperature",)), value=1e-300, stream=False)
@example(point=("messages", ("temperature",)), value=1e-300, stream=True)
@example(point=("chat", ("model",)), value="x" * 256, stream=False)
@example(point=("count_tokens", ("model",)), value="~no-such-user", stream=False)
@example(
    point=("chat json_schema", ("response_format", "json_schema", "schema", "properties", "a")),
    value={"type": "string", "maxLength": 10**30},
    stream=False,
)
@example(
    point=("chat json_schema", ("response_format", "json_schema", "schema", "properties", "n")),
    value={"type": "integer", "minimum": "é" * 100},
    stream=False,
)
def test_one_field_of_a_valid_body_replaced(
    http: httpx.Client, point: tuple[str, tuple], value: Any, stream: bool
):
    """Each field of a valid body, at any depth, given a value of the wrong type, or removed."""
    name, path = point
    route = ROUTES[name]
    send(http, prepared(route, replaced(route.body, path, value), path, stream))


@fuzz(100)
@given(
    point=st.sampled_from(STRINGS) | st.sampled_from(OBJECTS),
    text=ANY_TEXT | st.sampled_from([LONG_TEXT, "\x00", "\r\n", "é" * 5000, "中"]),
    value=WRONG_VALUES,
    ascii_only=st.booleans(),
    stream=st.booleans(),
)
@example(point=("chat", ()), text="中", value=1, ascii_only=True, stream=False)
@example(point=("responses", ()), text="a\r\nb", value=1, ascii_only=True, stream=False)
@example(point=("messages", ()), text=LONG_TEXT, value=1, ascii_only=True, stream=True)
def test_any_code_point_in_strings_and_names(
    http: httpx.Client,
    point: tuple[str, tuple],
    text: str,
    value: Any,
    ascii_only: bool,
    stream: bool,
):
    """Any text as a string of a valid body (content, names, ids...) or as a field's name.

    Escaped (``ascii_only``) a lone surrogate is a ``\\ud800`` escape; raw, it is
    invalid UTF-8. A field name the protocol does not know is ignored, and said to be.
    """
    name, path = point
    route = ROUTES[name]
    if isinstance(lookup(route.body, path), str):
        body, mutated = replaced(route.body, path, text), path
    else:
        body, mutated = replaced(route.body, (*path, text), value), (*path, text)
    send(http, prepared(route, body, mutated, stream, ascii_only))


@fuzz(40)
@given(
    name=st.sampled_from(list(ROUTES)),
    where=st.sampled_from(["Thanks.", "Reply in JSON.", "default", "now", "ann", "k"]),
    escapes=st.sampled_from(ESCAPES),
)
def test_hand_written_escapes_in_place_of_a_string(
    http: httpx.Client, name: str, where: str, escapes: str
):
    """Escapes written into the JSON text by hand, as other encoders write them."""
    raw = encoded(ROUTES[name].body).replace(f'"{where}"'.encode(), escapes.encode())
    send(http, post(ROUTES[name].path, raw))


def _broken_bodies() -> st.SearchStrategy[bytes]:
    valid = [encoded(route.body) for route in ROUTES.values()]
    truncated = st.builds(
        lambda raw, fraction: raw[: int(len(raw) * fraction)],
        st.sampled_from(valid),
        st.floats(0, 1, exclude_max=True),
    )
    spliced = st.builds(
        lambda raw, at, junk: raw[:at] + junk + raw[at:],
        st.sampled_from(valid),
        st.integers(0, 400),
        st.binary(min_size=1, max_size=8),
    )
    other_encodings = st.builds(
        lambda raw, codec: raw.decode().encode(codec),
        st.sampled_from(valid),
        st.sampled_from(["utf-16", "utf-16-le", "utf-32", "utf-8-sig", "latin-1"]),
    )
    literal = st.sampled_from(
        [
            b"",
            b" ",
            b"\xef\xbb\xbf",
            b"null",
            b"{",
            b"}",
            b'{"model": NaN}',
            b'{"model": "default", "max_tokens": Infinity}',
            b'{"model": "default", "max_tokens": -Infinity}',
            b'{"max_tokens": 1e999}',
            b'{"max_tokens": ' + b"9" * 5000 + b"}",
            b'{"model": "default", "model": 1}',
            b'{"a": 1}{"b": 2}',
            b'{"a": 1} trailing',
            b"[" * 100_000 + b"]" * 100_000,
            b'{"a":' * 100_000,
            b'{"model": "\\ud800"}',
            b'{"model": "\\uZZZZ"}',
            b'{"model": "\xed\xa0\x80"}',
            b'{"model": "\xff\xfe"}',
            b"\x00" * 64,
            b"model=default&max_tokens=1",
        ]
    )
    return st.one_of(truncated, spliced, other_encodings, literal, st.binary(max_size=256))


@fuzz(120)
@given(path=st.sampled_from(POST_PATHS), raw=_broken_bodies())
def test_truncated_and_non_json_bodies(http: httpx.Client, path: str, raw: bytes):
    send(http, post(path, raw))


CONTENT_TYPES = [
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json; charset=latin-1",
    "application/json; charset=utf-16",
    "APPLICATION/JSON",
    "application/vnd.api+json",
    "application/json;;;",
    ";",
    "*/*",
    "application/",
    "",
]


@fuzz(50)
@given(
    name=st.sampled_from(list(ROUTES)),
    content_type=st.sampled_from(CONTENT_TYPES) | st.binary(max_size=40).map(header_bytes),
    omit=st.booleans(),
)
def test_wrong_content_types(http: httpx.Client, name: str, content_type: Any, omit: bool):
    call = post(ROUTES[name].path, encoded(ROUTES[name].body), **{"content-type": content_type})
    if omit:
        del call.headers["content-type"]
    send(http, call)


QUERY_NAMES = ["status", "limit", "after", "after", "limit[]", "", "x"]
QUERY_VALUES = st.one_of(
    st.sampled_from(
        ["-1", "0", "1", "100", "101", "abc", "9" * 40, "9" * 5000, "1e3", "1.5", " 1", "zzz"]
    ),
    st.sampled_from(["queued", "running", "completed", "failed", "cancelled", "expired"]),
    st.sampled_from(["²", "١٢", "job_", "job_" + "0" * 24, "%", "\x00"]),
    st.text(st.characters(codec="utf-8"), max_size=20),
)


def _query(pairs: list[tuple[str, Any]]) -> str:
    """A query string; a ``bytes`` value is sent percent-encoded as it is (invalid UTF-8 too)."""
    parts = []
    for name, value in pairs:
        raw = value if isinstance(value, bytes) else value.encode()
        parts.append(f"{quote(name, safe='[]')}={quote_from_bytes(raw, safe='')}")
    return "&".join(parts)


@fuzz(100)
@given(
    path=st.sampled_from(GET_PATHS),
    pairs=st.lists(
        st.tuples(st.sampled_from(QUERY_NAMES), QUERY_VALUES | st.binary(max_size=8)), max_size=4
    ),
)
@example(path="/v1/jobs", pairs=[("limit", "-1")])
@example(path="/v1/jobs", pairs=[("limit", "abc")])
@example(path="/v1/jobs", pairs=[("after", "9" * 5000)])
@example(path="/v1/jobs", pairs=[("after", "9" * 40), ("limit", "1")])
@example(path="/v1/jobs", pairs=[("status", "zzz")])
@example(path="/v1/jobs", pairs=[("limit", "9" * 5000)])
def test_weird_query_parameters(http: httpx.Client, path: str, pairs: list[tuple[str, Any]]):
    send(http, Call("GET", f"{path}?{_query(pairs)}"))


JOB_IDS = st.one_of(
    st.sampled_from(["", "job_", "job_" + "0" * 24, "..", "%2e%2e", "events", "batch", "a/b"]),
    st.text(st.characters(codec="utf-8"), max_size=40),
    st.text(max_size=10000, alphabet="9"),
)


@fuzz(80)
@given(
    job_id=JOB_IDS | st.none(),
    method=st.sampled_from(["GET", "DELETE", "GET events"]),
    after=QUERY_VALUES | st.none(),
    last_event_id=(st.binary(max_size=40) | QUERY_VALUES.map(str.encode)).map(header_bytes)
    | st.none(),
)
@example(job_id=None, method="GET events", after="9" * 50, last_event_id=None)
@example(job_id=None, method="GET events", after="-1", last_event_id=None)
@example(job_id=None, method="GET events", after="²", last_event_id=None)
@example(job_id=None, method="GET events", after=None, last_event_id=b"garbage")
@example(job_id=None, method="GET events", after=None, last_event_id=b"9" * 5000)
def test_job_ids_cursors_and_last_event_ids(
    http: httpx.Client,
    finished_job: str,
    job_id: str | None,
    method: str,
    after: str | None,
    last_event_id: bytes | None,
):
    """Unknown and odd job ids; a finished job (``None``) read and resumed from any cursor."""
    job = finished_job if job_id is None else quote(job_id, safe="")
    if method == "GET events":
        query = "" if after is None else f"?{_query([('after', after)])}"
        headers = {} if last_event_id is None else {"last-event-id": last_event_id}
        send(http, Call("GET", f"/v1/jobs/{job}/events{query}", headers=headers))
    elif job_id is not None:  # the finished job stays, for the events above
        send(http, Call(method, f"/v1/jobs/{job}"))


HEADER_NAMES = [
    "x-request-id",
    "last-event-id",
    "authorization",
    "x-api-key",
    "accept",
    "accept-encoding",
    "origin",
    "anthropic-version",
    "openai-organization",
    "cookie",
]


@fuzz(60)
@given(
    target=st.sampled_from(list(ROUTES)) | st.sampled_from(GET_PATHS),
    headers=st.dictionaries(
        st.sampled_from(HEADER_NAMES),
        st.one_of(
            st.binary(max_size=200).map(header_bytes),
            st.text(st.characters(codec="utf-8"), max_size=40).map(
                lambda text: header_bytes(text.encode())
            ),
        ),
        max_size=4,
    ),
)
@example(target="/health", headers={"x-request-id": "zürich-ß-😀".encode()})
@example(target="chat", headers={"x-request-id": "请求".encode(), "accept": b"\xff"})
def test_odd_header_values(http: httpx.Client, target: str, headers: dict[str, bytes]):
    assume(all(value or name != "authorization" for name, value in headers.items()))
    if target in ROUTES:
        send(http, post(ROUTES[target].path, encoded(ROUTES[target].body), **headers))
    else:
        send(http, Call("GET", target, headers=headers))


@pytest.mark.parametrize("method", ["GET", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
def test_methods_the_routes_do_not_take(http: httpx.Client, method: str):
    for path in [*POST_PATHS, "/v1/models", "/health", "/metrics", "/v1/jobs/x/events", "/nope"]:
        body = None if method in ("GET", "HEAD") else b"{}"
        send(http, Call(method, path, body, {"content-type": "application/json"}))


def test_the_server_still_answers_a_plain_request(http: httpx.Client, memory: dict[str, Any]):
    """Run last: after everything above, a normal request is answered as usual."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 4,
    }
    answer = http.post("/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    assert 1 <= answer.json()["usage"]["completion_tokens"] <= 4
    assert http.get("/ready", timeout=TIMEOUT_S).status_code == 200
    after = rss_mib(memory["pid"])
    if memory["before"] is None or after is None:
        print("server RSS: unknown (its process was not found)")
    else:
        print(f"server RSS: {memory['before']:.0f} MiB before fuzzing, {after:.0f} MiB after")
