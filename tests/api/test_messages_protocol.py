"""The Anthropic Messages protocol against the official ``anthropic`` SDK's types.

Requests: every field maps onto the conversation, and every invalid field is a
400 naming its path. Responses: scripted delta sequences produce events and a
final ``Message`` that the SDK's pydantic types accept, and the SDK's own
stream accumulator rebuilds exactly the non-stream ``Message``.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import anthropic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from anthropic.types.shared.error_response import ErrorResponse
from pydantic import TypeAdapter

try:  # newer SDKs run on their own fork of httpx, with the same API
    import httpx2 as sdk_http
except ImportError:
    import httpx as sdk_http

from api.errors import ApiError, bad_request, not_found, overloaded
from api.output_parser import (
    ContentDelta,
    Delta,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from api.protocols.base import FinishKind, GenerationRequest, ResponseContext, SSEChunk, Usage
from api.protocols.messages import (
    PROTOCOL,
    count_tokens_body,
    error_body,
    parse,
    parse_count_tokens,
)
from shared.conversation import (
    AssistantMessage,
    ImagePart,
    ImageSource,
    SystemMessage,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    ToolMessage,
    UserMessage,
)

EVENTS = TypeAdapter(RawMessageStreamEvent)
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def body(**fields: Any) -> dict[str, Any]:
    base = {"model": "smollm2", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]}
    return {**base, **fields}


def error_of(payload: Any, parser=parse) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parser(payload)
    assert caught.value.status == 400
    assert caught.value.type == "invalid_request_error"
    return caught.value


# --- parsing ---------------------------------------------------------------------------------


def test_scalar_fields_map_onto_the_generation_request():
    request = parse(
        body(
            stream=True,
            stop_sequences=["END", "\n\nHuman:"],
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            metadata={"user_id": "u-1"},
            service_tier="auto",  # unknown to us: ignored
        )
    )
    assert request.model == "smollm2"
    assert request.max_tokens == 64 and request.max_tokens_param == "max_tokens"
    assert request.stream is True
    assert request.stop == ["END", "\n\nHuman:"]
    assert (request.temperature, request.top_p, request.top_k) == (0.5, 0.9, 40)
    assert request.metadata == {"user_id": "u-1"}
    assert request.conversation.messages == [UserMessage([TextPart("Hi")])]


def test_defaults_leave_sampling_to_preparation():
    request = parse(body())
    assert request.stream is False
    assert (request.temperature, request.top_p, request.top_k) == (None, None, None)
    assert request.stop == [] and request.metadata == {}
    assert request.conversation.tool_choice == ToolChoice("auto")
    assert request.conversation.thinking is None


@pytest.mark.parametrize(
    "system",
    ["Be brief.", [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]],
)
def test_system_string_or_text_blocks(system):
    messages = parse(body(system=system)).conversation.messages
    assert messages[0] == SystemMessage([TextPart("Be brief.")])


def test_images_from_base64_and_url():
    content = [
        {"type": "text", "text": "Compare"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}},
        {"type": "image", "source": {"type": "url", "url": "https://x.test/a.jpg"}},
    ]
    message = parse(body(messages=[{"role": "user", "content": content}])).conversation.messages[0]
    assert message == UserMessage(
        [
            TextPart("Compare"),
            ImagePart(ImageSource(data="iVBO", media_type="image/png")),
            ImagePart(ImageSource(url="https://x.test/a.jpg")),
        ]
    )


def test_tool_round_trip_becomes_calls_and_named_tool_messages():
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Two cities.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
                {
                    "type": "tool_use",
                    "id": "toolu_2",
                    "name": "get_weather",
                    "input": {"city": "Rome"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "timeout"}],
                    "is_error": True,
                },
                {"type": "text", "text": "Summarize."},
            ],
        },
    ]
    converted = parse(body(messages=messages, tools=[WEATHER_TOOL])).conversation.messages
    assert converted[1] == AssistantMessage(
        content=[TextPart("Checking.")],
        reasoning="Two cities.",
        tool_calls=[
            ToolCall("toolu_1", "get_weather", '{"city": "Paris"}'),
            ToolCall("toolu_2", "get_weather", '{"city": "Rome"}'),
        ],
    )
    assert converted[2:] == [
        ToolMessage("toolu_1", [TextPart("18C")], "get_weather"),
        ToolMessage("toolu_2", [TextPart("Error: "), TextPart("timeout")], "get_weather"),
        UserMessage([TextPart("Summarize.")]),
    ]


def test_tool_result_without_content_and_with_an_image():
    image = {"type": "image", "source": {"type": "url", "url": "https://x.test/p.png"}}
    content = [
        {"type": "tool_result", "tool_use_id": "toolu_9"},
        {"type": "tool_result", "tool_use_id": "toolu_8", "content": [image]},
    ]
    converted = parse(body(messages=[{"role": "user", "content": content}])).conversation.messages
    assert converted == [
        ToolMessage("toolu_9", [], None),
        ToolMessage("toolu_8", [ImagePart(ImageSource(url="https://x.test/p.png"))], None),
    ]


def test_final_assistant_turn_is_a_prefill():
    messages = [
        {"role": "user", "content": "Pick one: (A) Sol (B) Helios"},
        {"role": "assistant", "content": "The answer is ("},
    ]
    conversation = parse(body(messages=messages)).conversation
    assert conversation.messages[-1] == AssistantMessage([TextPart("The answer is (")], prefix=True)
    assert conversation.continues_last_message


def test_earlier_assistant_turns_are_not_prefills():
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert parse(body(messages=messages)).conversation.messages[1].prefix is False


def test_tools_and_every_tool_choice():
    tools = [WEATHER_TOOL, {"name": "noop", "input_schema": {"type": "object"}, "type": "custom"}]
    choices = {
        "auto": ToolChoice("auto", parallel=False),
        "any": ToolChoice("required", parallel=False),
        "none": ToolChoice("none"),
    }
    for kind, expected in choices.items():
        choice = (
            {"type": kind, "disable_parallel_tool_use": True} if kind != "none" else {"type": kind}
        )
        assert parse(body(tools=tools, tool_choice=choice)).conversation.tool_choice == expected
    named = parse(body(tools=tools, tool_choice={"type": "tool", "name": "noop"}))
    assert named.conversation.tool_choice == ToolChoice("function", "noop")  # parallel allowed
    assert named.conversation.tools == [
        Tool("get_weather", "Weather for a city", WEATHER_TOOL["input_schema"]),
        Tool("noop", None, {"type": "object"}),
    ]


@pytest.mark.parametrize(
    ("thinking", "expected"),
    [
        ({"type": "enabled", "budget_tokens": 1024}, True),
        ({"type": "disabled"}, False),
        ({"type": "adaptive"}, None),
    ],
)
def test_thinking_config(thinking, expected):
    assert parse(body(max_tokens=2048, thinking=thinking)).conversation.thinking is expected


def test_output_config_sets_effort_and_json_schema():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    config = {"effort": "xhigh", "format": {"type": "json_schema", "schema": schema}}
    conversation = parse(body(output_config=config)).conversation
    assert conversation.reasoning_effort == "xhigh"
    assert conversation.response_format.type == "json_schema"
    assert conversation.response_format.schema == schema


def user_turn(*blocks: Any) -> dict[str, Any]:
    """Body fields for one user turn made of ``blocks``."""
    return {"messages": [{"role": "user", "content": list(blocks)}]}


def assistant_turn(*blocks: Any) -> dict[str, Any]:
    """Body fields for a user turn followed by an assistant turn made of ``blocks``."""
    return {
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": list(blocks)},
        ]
    }


BMP = {"type": "base64", "media_type": "image/bmp", "data": "x"}


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"model": None}, "model", "valid string"),
        ({"model": ""}, "model", "at least 1 character"),
        ({"max_tokens": None}, "max_tokens", "valid integer"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"max_tokens": "64"}, "max_tokens", "valid integer"),
        ({"messages": []}, "messages", "at least 1 item"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role", "'user'"),
        ({"messages": [{"role": "user"}]}, "messages.0.content", "Field required"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages.0.content", "valid list"),
        (user_turn("x"), "messages.0.content.0", "object"),
        (
            user_turn({"type": "text", "text": "x"}, {"type": "image", "source": {"type": "file"}}),
            "messages.0.content.1.source.type",
            "'base64'",
        ),
        (
            user_turn({"type": "image", "source": BMP}),
            "messages.0.content.0.source.media_type",
            "image/bmp",
        ),
        (user_turn({"type": "tool_use", "id": "t"}), "messages.0.content.0.type", "got 'tool_use'"),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_result"}]}]},
            "messages.0.content.0.type",
            "got 'tool_result'",
        ),
        (
            assistant_turn({"type": "tool_use", "id": "t", "name": "f"}),
            "messages.1.content.0.input",
            "Field required",
        ),
        (
            user_turn({"type": "tool_result", "tool_use_id": "t", "content": 5}),
            "messages.0.content.0.content",
            "valid list",
        ),
        ({"system": 5}, "system", "valid list"),
        ({"system": [{"type": "image"}]}, "system.0.type", "'text'"),
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema", "Field required"),
        (
            {"tools": [{"name": "f", "input_schema": {}, "type": "bash_20250124"}]},
            "tools.0.type",
            "custom",
        ),
        ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools.1.name", "unique"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type", "'auto'"),
        ({"tool_choice": {"type": "any"}}, "tool_choice", "at least one tool"),
        (
            {"tool_choice": {"type": "tool"}, "tools": [WEATHER_TOOL]},
            "tool_choice.name",
            "required",
        ),
        (
            {"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER_TOOL]},
            "tool_choice.name",
            "'nope'",
        ),
        ({"stop_sequences": "END"}, "stop_sequences", "valid list"),
        ({"stop_sequences": [""]}, "stop_sequences.0", "at least 1 character"),
        ({"temperature": 1.5}, "temperature", "less than or equal to 1"),
        ({"temperature": "hot"}, "temperature", "valid number"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"top_k": -1}, "top_k", "greater than or equal to 0"),
        ({"stream": "yes"}, "stream", "valid boolean"),
        ({"metadata": {"user_id": 7}}, "metadata.user_id", "valid string"),
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens", "Field required"),
        ({"thinking": {"type": "enabled", "budget_tokens": 512}}, "thinking.budget_tokens", "1024"),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 2048},
            "thinking.budget_tokens",
            "less than max_tokens",
        ),
        ({"thinking": {"type": "on"}}, "thinking.type", "'enabled'"),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort", "'extreme'"),
    ],
)
def test_each_invalid_field_is_a_400_naming_its_path(fields, param, fragment):
    error = error_of(body(**fields))
    assert error.param == param
    assert error.message.startswith(f"{param}: ")
    assert fragment in error.message


def test_max_tokens_is_required():
    payload = body()
    del payload["max_tokens"]
    error = error_of(payload)
    assert (error.param, error.message) == ("max_tokens", "max_tokens: Field required")


def test_body_must_be_an_object():
    assert "JSON object" in error_of([1, 2]).message


def test_final_assistant_turn_cannot_hold_tool_use():
    messages = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}],
        },
    ]
    error = error_of(body(messages=messages, tools=[WEATHER_TOOL]))
    assert error.param == "messages.1.content.0"
    assert "prefill" in error.message


def test_count_tokens_needs_no_max_tokens_and_ignores_generation_fields():
    request = parse_count_tokens(
        {
            "model": "smollm2",
            "system": "Be brief.",
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [WEATHER_TOOL],
            "thinking": {"type": "enabled", "budget_tokens": 4096},
        }
    )
    assert request.max_tokens is None and request.stream is False
    assert request.conversation.thinking is True
    assert len(request.conversation.messages) == 2
    assert error_of({"model": "smollm2"}, parse_count_tokens).param == "messages"
    assert count_tokens_body(17) == {"input_tokens": 17}


# --- responses -------------------------------------------------------------------------------

CONTEXT = ResponseContext("msg_0123", "smollm2", 1_700_000_000, "fp")
PROMPT_USAGE = Usage(prompt_tokens=12, cached_tokens=4)


def run(
    deltas: list[Delta],
    kind: FinishKind,
    stop_sequence: str | None = None,
    completion_tokens: int = 9,
) -> tuple[list[SSEChunk], dict[str, Any]]:
    builder = PROTOCOL.builder(parse(body(stream=True)), CONTEXT)
    chunks = builder.start(PROMPT_USAGE)
    for delta in deltas:
        chunks += builder.delta(delta)
    final = Usage(prompt_tokens=12, completion_tokens=completion_tokens, cached_tokens=4)
    chunks += builder.finish(kind, final, stop_sequence)
    return chunks, builder.response()


def accumulate(chunks: list[SSEChunk]) -> dict[str, Any]:
    """The ``Message`` the SDK's stream helper builds from these events."""
    snapshot, json_bufs = None, {}
    for chunk in chunks:
        assert isinstance(chunk.data, dict) and chunk.event == chunk.data["type"]
        if chunk.event == "ping":
            continue
        event = EVENTS.validate_python(copy.deepcopy(chunk.data))
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)
    assert snapshot is not None
    return Message.model_validate(snapshot.to_dict()).model_dump()


def check(deltas: list[Delta], kind: FinishKind, stop: str | None = None) -> dict[str, Any]:
    """Validate both outputs with the SDK types and require that they agree."""
    chunks, response = run(deltas, kind, stop)
    message = Message.model_validate(response).model_dump()
    assert accumulate(chunks) == message
    return response


def event_names(chunks: list[SSEChunk]) -> list[str]:
    names = []
    for chunk in chunks:
        delta = chunk.data.get("delta", {}) if isinstance(chunk.data, dict) else {}
        names.append(f"{chunk.event}:{delta['type']}" if "type" in delta else str(chunk.event))
    return names


def test_text_only():
    response = check([ContentDelta("Hel"), ContentDelta("lo!")], "stop")
    assert response["id"] == "msg_0123" and response["model"] == "smollm2"
    assert response["content"] == [{"type": "text", "text": "Hello!"}]
    assert (response["stop_reason"], response["stop_sequence"]) == ("end_turn", None)
    assert response["usage"] == {
        "input_tokens": 8,
        "output_tokens": 9,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
        "service_tier": "standard",
    }


def test_stream_event_order_and_message_start():
    chunks, _ = run([ReasoningDelta("Hmm."), ContentDelta("Hi")], "stop")
    assert event_names(chunks) == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta:thinking_delta",
        "content_block_delta:signature_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta:text_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = chunks[0].data["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == 8 and start["usage"]["cache_read_input_tokens"] == 4
    assert chunks[2].data["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert chunks[-2].data["usage"]["output_tokens"] == 9


def test_thinking_then_text():
    deltas = [ReasoningDelta("Add "), ReasoningDelta("them."), ContentDelta("4")]
    response = check(deltas, "stop")
    assert response["content"] == [
        {"type": "thinking", "thinking": "Add them.", "signature": ""},
        {"type": "text", "text": "4"},
    ]


def test_two_tool_calls_with_streamed_json():
    deltas = [
        ContentDelta("Checking both."),
        ToolCallStart(0, "call_abc", "get_weather"),
        ToolCallArgsDelta(0, '{"city": '),
        ToolCallArgsDelta(0, '"Par'),
        ToolCallArgsDelta(0, 'is"}'),
        ToolCallEnd(0),
        ToolCallStart(1, "call_def", "get_weather"),
        ToolCallArgsDelta(1, '{"city": "Rome", "days": [1, 2]}'),
        ToolCallEnd(1),
    ]
    chunks, _ = run(deltas, "tool_calls")
    starts = [c.data["content_block"] for c in chunks if c.event == "content_block_start"]
    assert starts[1] == {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {}}
    pieces = [
        c.data["delta"]["partial_json"]
        for c in chunks
        if c.data.get("index") == 1 and c.event == "content_block_delta"
    ]
    assert pieces == ['{"city": ', '"Par', 'is"}']
    response = check(deltas, "tool_calls")
    assert response["content"][1:] == [
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Paris"}},
        {
            "type": "tool_use",
            "id": "toolu_def",
            "name": "get_weather",
            "input": {"city": "Rome", "days": [1, 2]},
        },
    ]
    assert response["stop_reason"] == "tool_use"


def test_max_tokens_inside_tool_arguments_keeps_complete_members():
    deltas = [
        ToolCallStart(0, "call_x", "get_weather"),
        ToolCallArgsDelta(0, '{"city": "Paris", "unit": "cel'),
    ]
    response = check(deltas, "length")
    assert response["stop_reason"] == "max_tokens"
    assert response["content"][0]["input"] == {"city": "Paris"}


def test_max_tokens_in_text():
    response = check([ContentDelta("Once upon a")], "length")
    assert (response["stop_reason"], response["stop_sequence"]) == ("max_tokens", None)


def test_arguments_that_are_not_an_object_become_empty_input():
    deltas = [ToolCallStart(0, "call_x", "f"), ToolCallArgsDelta(0, "[1, 2]"), ToolCallEnd(0)]
    _, response = run(deltas, "tool_calls")
    assert response["content"][0]["input"] == {}


@pytest.mark.parametrize("kind", ["stop_sequence", "stop"])
def test_stop_sequence(kind):
    response = check([ContentDelta("Done")], kind, "END")
    assert (response["stop_reason"], response["stop_sequence"]) == ("stop_sequence", "END")
    assert response["content"] == [{"type": "text", "text": "Done"}]


def test_tool_calls_ending_on_a_stop_token_report_tool_use():
    deltas = [ToolCallStart(0, "call_x", "f"), ToolCallArgsDelta(0, "{}"), ToolCallEnd(0)]
    assert check(deltas, "stop")["stop_reason"] == "tool_use"


def test_abort_pauses_the_turn():
    response = check([ContentDelta("Partial")], "abort")
    assert response["stop_reason"] == "pause_turn"


def test_empty_answer_is_a_valid_message():
    response = check([], "stop")
    assert response["content"] == [] and response["stop_reason"] == "end_turn"


def test_logprobs_are_ignored():
    builder = PROTOCOL.builder(parse(body()), CONTEXT)
    builder.start(PROMPT_USAGE)
    assert len(builder.delta(ContentDelta("a"), logprobs=[])) == 2  # block start, text delta


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (bad_request("max_tokens: Field required", "max_tokens"), "invalid_request_error"),
        (not_found("model 'x' not found", "model"), "not_found_error"),
        (overloaded("busy"), "overloaded_error"),
        (ApiError(500, "boom", "server_error"), "api_error"),
        (ApiError(429, "slow down", "rate_limit_exceeded"), "rate_limit_error"),
        (ApiError(401, "no key", "invalid_api_key"), "authentication_error"),
        (ApiError(422, "odd", "unprocessable"), "invalid_request_error"),
    ],
)
def test_error_bodies_use_anthropic_error_types(error, kind):
    payload = error_body(error)
    assert payload == {"type": "error", "error": {"type": kind, "message": error.message}}
    ErrorResponse.model_validate(payload)


def test_stream_error_is_an_error_event():
    builder = PROTOCOL.builder(parse(body()), CONTEXT)
    [chunk] = builder.stream_error(overloaded("busy"))
    assert chunk.event == "error"
    assert chunk.data == {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}


def test_protocol_row():
    assert (PROTOCOL.name, PROTOCOL.path, PROTOCOL.id_prefix) == (
        "messages",
        "/v1/messages",
        "msg_",
    )
    assert PROTOCOL.done_marker is None
    assert PROTOCOL.parse is parse and PROTOCOL.error_body is error_body


# --- through the SDK's HTTP client ---------------------------------------------------------------


def sdk_client(handler) -> anthropic.Anthropic:
    transport = sdk_http.MockTransport(handler)
    return anthropic.Anthropic(
        api_key="test",
        base_url="http://sluice.test",
        http_client=sdk_http.Client(transport=transport),
    )


SCRIPT: list[Delta] = [
    ReasoningDelta("Plan."),
    ContentDelta("Let me check."),
    ToolCallStart(0, "call_q", "get_weather"),
    ToolCallArgsDelta(0, '{"city":'),
    ToolCallArgsDelta(0, ' "Oslo"}'),
    ToolCallEnd(0),
]


SEEN: list[GenerationRequest] = []


def serve(request: sdk_http.Request) -> sdk_http.Response:
    """A stand-in server: parse the SDK's body, answer with the scripted deltas."""
    generation = parse(json.loads(request.content))
    SEEN.append(generation)
    builder = PROTOCOL.builder(generation, CONTEXT)
    chunks = builder.start(PROMPT_USAGE)
    for delta in SCRIPT:
        chunks += builder.delta(delta)
    chunks += builder.finish("tool_calls", Usage(12, 20, 4), None)
    if not generation.stream:
        return sdk_http.Response(200, json=builder.response())
    text = "".join(f"event: {c.event}\ndata: {json.dumps(c.data)}\n\n" for c in chunks)
    return sdk_http.Response(200, text=text, headers={"content-type": "text/event-stream"})


def test_sdk_request_parses_and_sdk_reads_both_responses():
    client = sdk_client(serve)
    arguments = dict(
        model="smollm2",
        max_tokens=2048,
        system="Be brief.",
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "auto"},
        thinking={"type": "enabled", "budget_tokens": 1024},
        stop_sequences=["END"],
        extra_body={"temperature": 0.2},  # no longer a named argument in recent SDKs
    )
    message = client.messages.create(**arguments)
    with client.messages.stream(**arguments) as stream:
        streamed = stream.get_final_message()
    assert streamed.model_dump() == message.model_dump()
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[2].input == {"city": "Oslo"}
    assert message.stop_reason == "tool_use"
    assert message.usage.input_tokens == 8 and message.usage.output_tokens == 20
    assert [request.stream for request in SEEN[-2:]] == [False, True]
    assert SEEN[-1].temperature == 0.2 and SEEN[-1].stop == ["END"]
    assert SEEN[-1].conversation.thinking is True


def test_sdk_raises_the_error_body():
    def refuse(request: sdk_http.Request) -> sdk_http.Response:
        return sdk_http.Response(400, json=error_body(error_of(json.loads(request.content))))

    client = sdk_client(refuse)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model="smollm2", max_tokens=0, messages=[{"role": "user", "content": "x"}]
        )
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in caught.value.message
