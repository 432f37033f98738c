"""Chat Completions: parsing into a GenerationRequest, and chunks the openai SDK accepts.

The SDK's pydantic types are the judge of every chunk and body, and its own
stream accumulator (``ChatCompletionStreamState``) checks that the stream adds
up to the non-stream body.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from api.errors import ApiError
from api.output_parser import (
    ContentDelta,
    Delta,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from api.protocols.base import GenerationRequest, LogprobEntry, ResponseContext, SSEChunk, Usage
from api.protocols.chat_completions import PROTOCOL, ChatCompletionBuilder, parse
from shared.conversation import (
    AssistantMessage,
    ImagePart,
    ImageSource,
    SystemMessage,
    TextPart,
    ToolCall,
    ToolMessage,
    UserMessage,
)

PNG = "data:image/png;base64,iVBORw0KGgo="


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def rejected(request: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(request)
    assert caught.value.status == 400
    return caught.value


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


# --- parsing ---------------------------------------------------------------------------


def test_minimal_body_gives_defaults() -> None:
    request = parse(body())
    assert request.model == "m"
    assert request.conversation.messages == [UserMessage([TextPart("hi")])]
    assert request.stream is False
    assert request.max_tokens is None
    assert request.temperature is None
    assert request.stop == []
    assert request.logprobs is None
    assert request.include_usage is False


def test_unknown_fields_are_ignored() -> None:
    assert parse(body(frobnicate=3, service_tier="auto")).model == "m"


def test_every_role_and_content_shape() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": [{"type": "text", "text": "use tools"}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "https://x.test/a.jpg"}},
                {"type": "image_url", "image_url": {"url": PNG, "detail": "high"}},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "they want weather",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        {"role": "user", "content": "again"},
    ]
    conversation = parse(body(messages=messages, tools=[WEATHER])).conversation
    assert conversation.messages == [
        SystemMessage([TextPart("be brief")]),
        SystemMessage([TextPart("use tools")], role="developer"),
        UserMessage(
            [
                TextPart("look"),
                ImagePart(ImageSource(url="https://x.test/a.jpg")),
                ImagePart(ImageSource(data="iVBORw0KGgo=", media_type="image/png", detail="high")),
            ]
        ),
        AssistantMessage(
            reasoning="they want weather",
            tool_calls=[ToolCall("call_1", "weather", '{"city": "Oslo"}')],
        ),
        ToolMessage("call_1", [TextPart("sunny")]),
        AssistantMessage([TextPart("no")]),
        UserMessage([TextPart("again")]),
    ]


def test_tool_call_arguments_given_as_an_object_are_serialised() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]}]
    assistant = parse(body(messages=messages)).conversation.messages[1]
    assert assistant.tool_calls == [ToolCall("c", "f", '{"a": 1}')]


def test_prefix_and_continue_final_message_continue_the_last_turn() -> None:
    prefix = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "Once", "prefix": True},
    ]
    assert parse(body(messages=prefix)).conversation.continues_last_message
    plain = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Once"}]
    request = parse(body(messages=plain, continue_final_message=True))
    assert request.conversation.continues_last_message


def test_tools_and_tool_choice() -> None:
    request = parse(body(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    (tool,) = request.conversation.tools
    assert (tool.name, tool.description) == ("weather", "Weather in a city")
    assert tool.parameters["properties"] == {"city": {"type": "string"}}
    assert request.conversation.tool_choice.mode == "required"
    assert request.echo["parallel_tool_calls"] is False
    assert request.conversation.tool_choice.parallel is False
    named = {"type": "function", "function": {"name": "weather"}}
    choice = parse(body(tools=[WEATHER], tool_choice=named)).conversation.tool_choice
    assert (choice.mode, choice.name, choice.parallel) == ("function", "weather", True)
    bare = {"type": "function", "function": {"name": "now"}}
    assert parse(body(tools=[bare])).conversation.tools[0].parameters["type"] == "object"


@pytest.mark.parametrize(
    ("response_format", "expected"),
    [
        ({"type": "text"}, ("text", None, None, False)),
        ({"type": "json_object"}, ("json_object", None, None, False)),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"type": "object"}, "strict": True},
            },
            ("json_schema", {"type": "object"}, "n", True),
        ),
    ],
)
def test_response_format(response_format: dict[str, Any], expected: tuple) -> None:
    parsed = parse(body(response_format=response_format)).conversation.response_format
    assert (parsed.type, parsed.schema, parsed.name, parsed.strict) == expected


def test_sampling_fields() -> None:
    request = parse(
        body(
            temperature=0.5,
            top_p=0.9,
            seed=7,
            presence_penalty=-1,
            frequency_penalty=1.5,
            top_k=-1,
            min_p=0.05,
            repetition_penalty=1.1,
            stop="END",
            user="u1",
            metadata={"k": "v"},
            n=1,
        )
    )
    assert (request.temperature, request.top_p, request.seed) == (0.5, 0.9, 7)
    assert (request.presence_penalty, request.frequency_penalty) == (-1.0, 1.5)
    assert (request.top_k, request.min_p, request.repetition_penalty) == (0, 0.05, 1.1)
    assert request.stop == ["END"]
    assert request.metadata == {"k": "v"}
    assert parse(body(top_k=40)).top_k == 40
    assert parse(body(stop=["a", "b"])).stop == ["a", "b"]


def test_max_tokens_names_the_field_it_came_from() -> None:
    request = parse(body(max_tokens=10))
    assert (request.max_tokens, request.max_tokens_param) == (10, "max_tokens")
    request = parse(body(max_completion_tokens=20, max_tokens=10))
    assert (request.max_tokens, request.max_tokens_param) == (20, "max_completion_tokens")


def test_logprobs_and_stream_options() -> None:
    assert parse(body(logprobs=True)).logprobs == 0
    assert parse(body(logprobs=True, top_logprobs=5)).logprobs == 5
    assert parse(body(logprobs=False)).logprobs is None
    assert parse(body(stream=True, stream_options={"include_usage": True})).include_usage
    assert not parse(body(stream=False, stream_options={"include_usage": True})).include_usage


@pytest.mark.parametrize(
    ("fields", "thinking", "effort"),
    [
        ({}, None, None),
        ({"reasoning_effort": "low"}, True, "low"),
        ({"reasoning_effort": "high"}, True, "high"),
        ({"reasoning_effort": "minimal"}, True, "low"),
        ({"reasoning_effort": "none"}, False, None),
        ({"chat_template_kwargs": {"enable_thinking": False}}, False, None),
        (
            {"reasoning_effort": "medium", "chat_template_kwargs": {"thinking": False}},
            False,
            "medium",
        ),
    ],
)
def test_reasoning_controls(
    fields: dict[str, Any], thinking: bool | None, effort: str | None
) -> None:
    conversation = parse(body(**fields)).conversation
    assert (conversation.thinking, conversation.reasoning_effort) == (thinking, effort)


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"model": None}, "model", "required"),
        ({"model": 5}, "model", "non-empty string"),
        ({"messages": []}, "messages", "at least one"),
        ({"messages": "hi"}, "messages", "array"),
        ({"messages": ["hi"]}, "messages[0]", "JSON object"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "required"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "'tool'"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "required"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string or"),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages[0].content[0].type",
            "'image_url' in a user message",
        ),
        (
            {"messages": [{"role": "system", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
            "'text' in a system message",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
            "messages[0].content[0].text",
            "a string",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "ftp://x"}}],
                    }
                ]
            },
            "messages[0].content[0].image_url.url",
            "http(s) URL",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "data:text/plain;base64,AA"}}
                        ],
                    }
                ]
            },
            "messages[0].content[0].image_url.url",
            "base64 image",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "required"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {}}]}]},
            "messages[0].tool_calls[0].function.name",
            "required",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": "a", "prefix": True},
                    {"role": "user", "content": "b"},
                ]
            },
            "messages[0].prefix",
            "last message",
        ),
        ({"continue_final_message": True}, "continue_final_message", 'role "user"'),
        ({"tools": [{"type": "custom", "custom": {}}]}, "tools[0].type", "'function'"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "required"),
        (
            {"tools": [{"type": "function", "function": {"name": ""}}]},
            "tools[0].function.name",
            "non-empty",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
            "JSON schema",
        ),
        ({"tool_choice": "any"}, "tool_choice", "'required'"),
        ({"tool_choice": "required"}, "tool_choice", "needs at least one tool"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "clock"}},
            },
            "tool_choice.function.name",
            "(weather)",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "'json_schema'"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
            "response_format.json_schema.schema",
            "required",
        ),
        ({"stop": ["a"] * 17}, "stop", "at most 16"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"stop": 5}, "stop", "non-empty string"),
        ({"max_tokens": 0}, "max_tokens", "an integer >= 1"),
        ({"max_completion_tokens": "9"}, "max_completion_tokens", "an integer >= 1"),
        ({"temperature": 2.5}, "temperature", "between 0 and 2"),
        ({"temperature": "hot"}, "temperature", "between 0 and 2"),
        ({"top_p": 0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"presence_penalty": 3}, "presence_penalty", "between -2 and 2"),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "between -2 and 2"),
        ({"seed": 1.5}, "seed", "an integer"),
        ({"seed": True}, "seed", "an integer"),
        ({"logprobs": "yes"}, "logprobs", "true or false"),
        ({"top_logprobs": 3}, "top_logprobs", "logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
        ({"stream": "yes"}, "stream", "true or false"),
        (
            {"stream": True, "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
            "true or false",
        ),
        ({"stream_options": []}, "stream_options", "JSON object"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort", "'high'"),
        ({"n": 2}, "n", "n > 1 is only accepted by a synchronous request"),
        ({"n": 0}, "n", ">= 1"),
        ({"top_k": -2}, "top_k", ">= -1"),
        ({"min_p": 1.5}, "min_p", "between 0 and 1"),
        ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
        ({"metadata": {"k": 1}}, "metadata", "string values"),
        ({"functions": [{"name": "f"}]}, "functions", "tools"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "true or false"),
        ({"user": 5}, "user", "a string"),
        (
            {"chat_template_kwargs": {"enable_thinking": "no"}},
            "chat_template_kwargs.enable_thinking",
            "true",
        ),
    ],
)
def test_errors_name_the_field_the_value_and_what_is_accepted(
    fields: dict[str, Any], param: str, words: str
) -> None:
    error = rejected(body(**fields))
    assert error.param == param
    assert error.message.startswith(param) or param in error.message
    assert words in error.message
    assert error.type == "invalid_request_error"


def test_error_message_shows_the_value() -> None:
    error = rejected(body(temperature=7))
    assert error.message == "temperature must be a number between 0 and 2, got 7"


def test_body_must_be_an_object() -> None:
    assert rejected([]).message == "the request body must be a JSON object, got []"  # type: ignore[arg-type]


def test_error_body_has_the_openai_shape() -> None:
    error = rejected(body(n=3))
    assert PROTOCOL.error_body(error) == {
        "error": {
            "message": "n > 1 is only accepted by a synchronous request, not in a job or "
            "batch; got 3",
            "type": "invalid_request_error",
            "param": "n",
            "code": "unsupported_parameter",
        }
    }


def test_protocol_row() -> None:
    assert (PROTOCOL.name, PROTOCOL.path, PROTOCOL.id_prefix) == (
        "chat.completions",
        "/v1/chat/completions",
        "chatcmpl-",
    )
    assert PROTOCOL.done_marker == "[DONE]"
    assert PROTOCOL.parse is parse


# --- builder ---------------------------------------------------------------------------

CONTEXT = ResponseContext("chatcmpl-1", "m", 1_700_000_000, "fp_sluice")
Step = Delta | tuple[Delta, list[LogprobEntry]]


def run(
    steps: list[Step],
    kind: str = "stop",
    stop_sequence: str | None = None,
    **request_fields: Any,
) -> tuple[ChatCompletionBuilder, list[SSEChunk]]:
    """Drive a builder through a scripted generation and return every chunk."""
    request = GenerationRequest(
        model="m", conversation=parse(body()).conversation, **request_fields
    )
    builder = PROTOCOL.builder(request, CONTEXT)
    assert isinstance(builder, ChatCompletionBuilder)
    chunks = builder.start(Usage(prompt_tokens=12, cached_tokens=4))
    for step in steps:
        delta, logprobs = step if isinstance(step, tuple) else (step, None)
        chunks += builder.delta(delta, logprobs)
    final = Usage(prompt_tokens=12, completion_tokens=9, cached_tokens=4, reasoning_tokens=3)
    chunks += builder.finish(kind, final, stop_sequence)  # type: ignore[arg-type]
    return builder, chunks


def sdk_chunks(chunks: list[SSEChunk]) -> list[ChatCompletionChunk]:
    """Every chunk is data-only JSON the SDK validates; a snapshot of it is taken now."""
    assert all(chunk.event is None for chunk in chunks)
    return [
        ChatCompletionChunk.model_validate(json.loads(json.dumps(chunk.data))) for chunk in chunks
    ]


def accumulated(chunks: list[SSEChunk]) -> dict[str, Any]:
    state = ChatCompletionStreamState()
    for chunk in sdk_chunks(chunks):
        state.handle_chunk(chunk)
    return state.get_final_completion().model_dump(exclude_none=True)


def non_stream(builder: ChatCompletionBuilder) -> dict[str, Any]:
    body = builder.response()
    return ChatCompletion.model_validate(copy.deepcopy(body)).model_dump(exclude_none=True)


def comparable(message: dict[str, Any]) -> dict[str, Any]:
    """A message without what only the accumulator adds; the stream starts content at ""."""
    message = {key: value for key, value in message.items() if key != "parsed"}
    message["content"] = message.get("content") or None
    for call in message.get("tool_calls", []):
        call.pop("index", None)
        call["function"].pop("parsed_arguments", None)
    return message


def assert_stream_equals_response(builder: ChatCompletionBuilder, chunks: list[SSEChunk]) -> None:
    streamed, whole = accumulated(chunks), non_stream(builder)
    streamed_choice, whole_choice = streamed["choices"][0], whole["choices"][0]
    assert comparable(streamed_choice["message"]) == comparable(whole_choice["message"])
    assert streamed_choice["finish_reason"] == whole_choice["finish_reason"]
    assert streamed_choice.get("logprobs") == whole_choice.get("logprobs")
    for key in ("id", "created", "model", "system_fingerprint"):
        assert streamed[key] == whole[key]


def test_plain_text_stream() -> None:
    builder, chunks = run([ContentDelta("Hel"), ContentDelta("lo")])
    parsed = sdk_chunks(chunks)
    assert parsed[0].choices[0].delta.role == "assistant"
    assert parsed[0].choices[0].delta.content == ""
    assert [c.choices[0].delta.content for c in parsed[1:3]] == ["Hel", "lo"]
    assert parsed[-1].choices[0].finish_reason == "stop"
    for chunk in parsed:
        assert (chunk.id, chunk.object, chunk.created, chunk.model) == (
            "chatcmpl-1",
            "chat.completion.chunk",
            1_700_000_000,
            "m",
        )
        assert chunk.system_fingerprint == "fp_sluice"
        assert chunk.usage is None
    whole = ChatCompletion.model_validate(builder.response())
    assert whole.choices[0].message.content == "Hello"
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].logprobs is None
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (
        12,
        9,
        21,
    )
    assert whole.usage.prompt_tokens_details.cached_tokens == 4
    assert whole.usage.completion_tokens_details.reasoning_tokens == 3
    assert builder.response()["usage"]["prompt_cache_hit_tokens"] == 4
    assert builder.response()["usage"]["prompt_cache_miss_tokens"] == 8
    assert_stream_equals_response(builder, chunks)


def test_reasoning_then_content() -> None:
    builder, chunks = run([ReasoningDelta("think "), ReasoningDelta("more"), ContentDelta("42")])
    parsed = sdk_chunks(chunks)
    for name in ("reasoning", "reasoning_content"):
        assert [c.choices[0].delta.model_extra.get(name) for c in parsed[1:3]] == ["think ", "more"]
    message = builder.response()["choices"][0]["message"]
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == (
        "think more",
        "think more",
        "42",
    )
    assert_stream_equals_response(builder, chunks)


TWO_CALLS: list[Step] = [
    ContentDelta("Checking."),
    ToolCallStart(0, "call_a", "weather"),
    ToolCallArgsDelta(0, '{"city": '),
    ToolCallArgsDelta(0, '"Oslo"}'),
    ToolCallEnd(0),
    ToolCallStart(1, "call_b", "clock"),
    ToolCallArgsDelta(1, "{}"),
    ToolCallEnd(1),
]


def test_two_tool_calls_with_streamed_arguments() -> None:
    builder, chunks = run(TWO_CALLS, kind="tool_calls")
    parsed = sdk_chunks(chunks)
    opened = parsed[2].choices[0].delta.tool_calls[0]
    assert (opened.index, opened.id, opened.type) == (0, "call_a", "function")
    assert (opened.function.name, opened.function.arguments) == ("weather", "")
    piece = chunks[3].data["choices"][0]["delta"]["tool_calls"][0]
    assert piece == {"index": 0, "function": {"arguments": '{"city": '}}
    assert parsed[-1].choices[0].finish_reason == "tool_calls"
    whole = ChatCompletion.model_validate(builder.response())
    calls = whole.choices[0].message.tool_calls
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        ("call_a", "weather", '{"city": "Oslo"}'),
        ("call_b", "clock", "{}"),
    ]
    assert whole.choices[0].message.content == "Checking."
    assert_stream_equals_response(builder, chunks)


def test_tool_calls_without_text_have_null_content_and_upgrade_a_plain_stop() -> None:
    builder, chunks = run(TWO_CALLS[1:], kind="stop")
    message = builder.response()["choices"][0]["message"]
    assert message["content"] is None
    assert builder.response()["choices"][0]["finish_reason"] == "tool_calls"
    assert_stream_equals_response(builder, chunks)


@pytest.mark.parametrize(
    ("kind", "reason"),
    [("stop", "stop"), ("stop_sequence", "stop"), ("length", "length"), ("abort", "stop")],
)
def test_finish_reasons(kind: str, reason: str) -> None:
    builder, chunks = run([ContentDelta("a")], kind=kind)
    assert sdk_chunks(chunks)[-1].choices[0].finish_reason == reason
    assert builder.response()["choices"][0]["finish_reason"] == reason


def test_stop_sequence_is_reported_as_stop_reason() -> None:
    builder, chunks = run([ContentDelta("a")], kind="stop_sequence", stop_sequence="END")
    assert chunks[-1].data["choices"][0]["stop_reason"] == "END"
    assert builder.response()["choices"][0]["stop_reason"] == "END"
    builder, _ = run([ContentDelta("a")], kind="stop_sequence", stop_sequence="###")
    assert builder.response()["choices"][0]["stop_reason"] == "###"


def test_include_usage_adds_a_usage_chunk_with_no_choices() -> None:
    builder, chunks = run([ContentDelta("a")], stream=True, include_usage=True)
    parsed = sdk_chunks(chunks)
    assert all("usage" in chunk.data for chunk in chunks)
    assert parsed[-1].choices == []
    assert parsed[-1].usage is not None
    assert parsed[-1].usage.total_tokens == 21
    assert parsed[-2].choices[0].finish_reason == "stop"
    assert accumulated(chunks)["usage"] == non_stream(builder)["usage"]


def lp(token: str, logprob: float) -> LogprobEntry:
    alternatives = [(token, list(token.encode()), logprob), ("x", [120], -3.0)]
    return LogprobEntry(token, list(token.encode()), logprob, alternatives)


def test_logprobs_for_answer_tokens() -> None:
    steps: list[Step] = [
        (ReasoningDelta("hm"), [lp("hm", -0.5)]),
        (ContentDelta("Hi"), [lp("H", -0.1), lp("i", float("-inf"))]),
        (ContentDelta("!"), [lp("!", -0.2)]),
    ]
    builder, chunks = run(steps, logprobs=1)
    parsed = sdk_chunks(chunks)
    first = parsed[2].choices[0].logprobs.content
    assert [(e.token, e.logprob, e.bytes) for e in first] == [
        ("H", -0.1, [72]),
        ("i", -9999.0, [105]),
    ]
    assert [(t.token, t.logprob) for t in first[0].top_logprobs] == [("H", -0.1), ("x", -3.0)]
    assert parsed[1].choices[0].logprobs is None  # reasoning tokens are not answer content
    whole = ChatCompletion.model_validate(builder.response())
    assert [e.token for e in whole.choices[0].logprobs.content] == ["H", "i", "!"]
    assert_stream_equals_response(builder, chunks)


def test_logprobs_requested_but_reasoning_only_gives_an_empty_list() -> None:
    builder, _ = run([ReasoningDelta("hm")], logprobs=0)
    assert builder.response()["choices"][0]["logprobs"] == {"content": []}


def test_chunks_do_not_change_after_they_are_returned() -> None:
    builder = ChatCompletionBuilder(GenerationRequest("m", parse(body()).conversation), CONTEXT)
    builder.start(Usage())
    (opened,) = builder.delta(ToolCallStart(0, "c", "f"))
    snapshot = copy.deepcopy(opened.data)
    builder.delta(ToolCallArgsDelta(0, '{"a": 1}'))
    assert opened.data == snapshot


def test_stream_error_is_a_data_only_error_chunk() -> None:
    builder = ChatCompletionBuilder(GenerationRequest("m", parse(body()).conversation), CONTEXT)
    (chunk,) = builder.stream_error(ApiError(500, "engine failed", "server_error"))
    assert chunk.event is None
    assert chunk.data == {
        "error": {"message": "engine failed", "type": "server_error", "param": None, "code": None}
    }
