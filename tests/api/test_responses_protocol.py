"""Responses: parsing input items into a conversation, and events the openai SDK accepts.

Every event is validated with the SDK's own event class for its ``type``, and
the SDK's ``ResponseStreamState`` accumulates the stream so it can be compared
with the non-stream body.
"""

from __future__ import annotations

import copy
import json
import typing
from typing import Any

import pytest
from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from api.errors import ApiError
from api.output_parser import (
    ContentDelta,
    Delta,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from api.protocols.base import LogprobEntry, ResponseContext, SSEChunk, Usage
from api.protocols.responses import PROTOCOL, ResponsesBuilder, parse
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
WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": "hi", **fields}


def rejected(request: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(request)
    assert caught.value.status == 400
    return caught.value


# --- parsing ---------------------------------------------------------------------------


def test_string_input_and_instructions() -> None:
    request = parse(body(instructions="be brief"))
    assert request.conversation.messages == [
        SystemMessage([TextPart("be brief")]),
        UserMessage([TextPart("hi")]),
    ]
    assert request.max_tokens_param == "max_output_tokens"
    assert request.stream is False
    assert request.logprobs is None


def test_unknown_fields_are_ignored() -> None:
    assert parse(body(frobnicate=1, store=True)).model == "m"


def test_input_items_become_turns() -> None:
    items = [
        {"role": "developer", "content": "use tools"},
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "weather?"},
                {"type": "input_image", "image_url": "https://x.test/a.png", "detail": "auto"},
                {"type": "input_image", "image_url": PNG},
                {"type": "input_file", "file_data": PNG, "filename": "a.png"},
            ],
        },
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "look it up"}],
        },
        {
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "weather",
            "arguments": '{"city":"Oslo"}',
        },
        {"type": "function_call", "call_id": "call_2", "name": "clock", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "call_2",
            "output": [{"type": "input_text", "text": "noon"}],
        },
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "done"}]},
        {"type": "reasoning", "id": "rs_3", "summary": [], "encrypted_content": "opaque"},
        {"role": "assistant", "content": "Sunny at noon."},
        {"role": "system", "content": [{"type": "input_text", "text": "late rule"}]},
        {"role": "user", "content": "thanks"},
    ]
    messages = parse(body(input=items, tools=[WEATHER])).conversation.messages
    assert messages == [
        SystemMessage([TextPart("use tools")], role="developer"),
        UserMessage(
            [
                TextPart("weather?"),
                ImagePart(ImageSource(url="https://x.test/a.png")),
                ImagePart(ImageSource(data="iVBORw0KGgo=", media_type="image/png")),
                ImagePart(ImageSource(data="iVBORw0KGgo=", media_type="image/png")),
            ]
        ),
        AssistantMessage(
            [TextPart("Checking.")],
            reasoning="look it up",
            tool_calls=[
                ToolCall("call_1", "weather", '{"city":"Oslo"}'),
                ToolCall("call_2", "clock", "{}"),
            ],
        ),
        ToolMessage("call_1", [TextPart("sunny")], name="weather"),
        ToolMessage("call_2", [TextPart("noon")], name="clock"),
        AssistantMessage([TextPart("Sunny at noon.")], reasoning="done"),
        SystemMessage([TextPart("late rule")]),
        UserMessage([TextPart("thanks")]),
    ]


def test_function_call_without_a_preceding_message_opens_an_assistant_turn() -> None:
    items = [
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}},
    ]
    assert parse(body(input=items)).conversation.messages[1] == AssistantMessage(
        tool_calls=[ToolCall("c", "f", '{"a": 1}')]
    )


def test_tools_tool_choice_and_text_format() -> None:
    request = parse(
        body(
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "weather"},
            parallel_tool_calls=False,
            text={
                "format": {
                    "type": "json_schema",
                    "name": "w",
                    "schema": {"type": "object"},
                    "strict": True,
                }
            },
        )
    )
    conversation = request.conversation
    assert conversation.tools[0].name == "weather"
    assert conversation.tools[0].parameters["properties"] == {"city": {"type": "string"}}
    assert (conversation.tool_choice.mode, conversation.tool_choice.name) == ("function", "weather")
    assert conversation.tool_choice.parallel is False
    assert conversation.response_format.type == "json_schema"
    assert conversation.response_format.schema == {"type": "object"}
    assert conversation.response_format.strict is True
    assert request.echo["parallel_tool_calls"] is False
    assert parse(body(tools=[WEATHER], tool_choice="none")).conversation.tool_choice.mode == "none"
    assert (
        parse(body(text={"format": {"type": "json_object"}})).conversation.response_format.type
        == "json_object"
    )


def test_sampling_and_echoed_fields() -> None:
    request = parse(
        body(
            max_output_tokens=50,
            temperature=0.2,
            top_p=0.5,
            stream=True,
            metadata={"k": "v"},
            user="u1",
            reasoning={"effort": "high", "summary": "auto"},
        )
    )
    assert (request.max_tokens, request.temperature, request.top_p) == (50, 0.2, 0.5)
    assert request.stream is True
    assert request.metadata == {"k": "v"}
    assert request.echo["user"] == "u1"
    assert (request.conversation.thinking, request.conversation.reasoning_effort) == (True, "high")
    assert request.echo["reasoning"] == {"effort": "high", "summary": None}
    none = parse(body(reasoning={"effort": "none"})).conversation
    assert none.thinking is False


def test_logprobs_come_from_include_or_top_logprobs() -> None:
    assert parse(body(include=["message.output_text.logprobs"])).logprobs == 0
    assert parse(body(include=["message.output_text.logprobs"], top_logprobs=3)).logprobs == 3
    assert parse(body(top_logprobs=2)).logprobs == 2
    with pytest.raises(ApiError, match="not supported"):
        parse(body(include=["reasoning.encrypted_content"]))


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"model": None}, "model", "required"),
        ({"input": None}, "input", "required"),
        ({"input": []}, "input", "non-empty array"),
        ({"input": 5}, "input", "a string or"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type", "'function_call_output'"),
        ({"input": [{"content": "x"}]}, "input[0].type", "required"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "stored items"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "'assistant'"),
        ({"input": [{"role": "user"}]}, "input[0].content", "required"),
        ({"input": [{"role": "user", "content": 1}]}, "input[0].content", "a string or"),
        (
            {"input": [{"role": "system", "content": [{"type": "input_image", "image_url": PNG}]}]},
            "input[0].content[0].type",
            "in a system message",
        ),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}
                ]
            },
            "input[0].content[0].file_id",
            "image_url",
        ),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": "file:///etc"}],
                    }
                ]
            },
            "input[0].content[0].image_url",
            "http(s) URL",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].file_data",
            "only images",
        ),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_file", "file_data": "data:application/pdf;base64,AA"}
                        ],
                    }
                ]
            },
            "input[0].content[0].file_data",
            "base64 image",
        ),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
            "required",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]},
            "input[0].name",
            "required",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 3}]},
            "input[0].arguments",
            "JSON string",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c"}]},
            "input[0].output",
            "required",
        ),
        (
            {
                "input": [
                    {
                        "type": "function_call_output",
                        "call_id": "c",
                        "output": [{"type": "refusal"}],
                    }
                ]
            },
            "input[0].output[0].type",
            "in a function_call_output",
        ),
        ({"instructions": 5}, "instructions", "a string"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "built-in tools"),
        ({"tools": [{"type": "function"}]}, "tools[0].name", "required"),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": "x"}]},
            "tools[0].parameters",
            "JSON schema",
        ),
        ({"tool_choice": "any"}, "tool_choice", "'required'"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice.type", "built-in tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs at least one tool"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "clock"}},
            "tool_choice.name",
            "(weather)",
        ),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type", "'json_object'"),
        (
            {"text": {"format": {"type": "json_schema", "name": "n"}}},
            "text.format.schema",
            "required",
        ),
        ({"text": "json"}, "text", "JSON object"),
        ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
        ({"temperature": -1}, "temperature", "between 0 and 2"),
        ({"top_p": 0}, "top_p", "(0, 1]"),
        ({"top_logprobs": 25}, "top_logprobs", "between 0 and 20"),
        ({"include": "all"}, "include", "an array"),
        ({"reasoning": {"effort": "huge"}}, "reasoning.effort", "'medium'"),
        ({"reasoning": "high"}, "reasoning", "JSON object"),
        ({"stream": 1}, "stream", "true or false"),
        ({"store": "no"}, "store", "true or false"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "true or false"),
        ({"metadata": {"k": "v" * 600}}, "metadata", "512"),
        ({"user": 5}, "user", "a string"),
        ({"previous_response_id": 7}, "previous_response_id", "a non-empty string"),
        ({"background": True, "store": False}, "store", "must be stored"),
        ({"conversation": "conv_1"}, "conversation", "not supported"),
    ],
)
def test_errors_name_the_field_the_value_and_what_is_accepted(
    fields: dict[str, Any], param: str, words: str
) -> None:
    error = rejected(body(**fields))
    assert error.param == param
    assert param in error.message
    assert words in error.message


def test_error_message_shows_the_value() -> None:
    error = rejected(body(max_output_tokens=-5))
    assert error.message == "max_output_tokens must be an integer >= 1, got -5"


def test_error_body_has_the_openai_shape() -> None:
    error = rejected(body(conversation="conv_1"))
    assert PROTOCOL.error_body(error)["error"]["param"] == "conversation"
    assert set(PROTOCOL.error_body(error)["error"]) == {"message", "type", "param", "code"}


def test_protocol_row() -> None:
    assert (PROTOCOL.name, PROTOCOL.path, PROTOCOL.id_prefix) == (
        "responses",
        "/v1/responses",
        "resp_",
    )
    assert PROTOCOL.done_marker is None


# --- builder ---------------------------------------------------------------------------

CONTEXT = ResponseContext("resp_1", "m", 1_700_000_000, "fp_sluice")
Step = Delta | tuple[Delta, list[LogprobEntry]]
EVENT_TYPES = {
    typing.get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}


def run(
    steps: list[Step], kind: str = "stop", request: dict[str, Any] | None = None
) -> tuple[ResponsesBuilder, list[SSEChunk]]:
    """Drive a builder through a scripted generation and return every event."""
    builder = PROTOCOL.builder(parse(request or body()), CONTEXT)
    assert isinstance(builder, ResponsesBuilder)
    events = builder.start(Usage(prompt_tokens=12, cached_tokens=4))
    for step in steps:
        delta, logprobs = step if isinstance(step, tuple) else (step, None)
        events += builder.delta(delta, logprobs)
    final = Usage(prompt_tokens=12, completion_tokens=9, cached_tokens=4, reasoning_tokens=3)
    events += builder.finish(kind, final, None)  # type: ignore[arg-type]
    return builder, events


def sdk_events(chunks: list[SSEChunk]) -> list[Any]:
    """Each event validates as the SDK class of its type; the SSE name is the type."""
    events = []
    for chunk in chunks:
        data = json.loads(json.dumps(chunk.data))
        assert chunk.event == data["type"]
        events.append(EVENT_TYPES[data["type"]].model_validate(data))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    return events


def types(chunks: list[SSEChunk]) -> list[str]:
    return [chunk.data["type"] for chunk in chunks]


def sdk_final(chunks: list[SSEChunk]) -> Response:
    """Feed the SDK's stream state, which raises on a malformed lifecycle; return its result."""
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    handled = [out for event in sdk_events(chunks) for out in state.handle_event(event)]
    return handled[-1].response


def rebuilt_output(chunks: list[SSEChunk]) -> list[dict[str, Any]]:
    """The output items as a client rebuilds them from the added and delta events alone."""
    output: list[dict[str, Any]] = []
    for event in (chunk.data for chunk in chunks):
        kind, index = event["type"], event.get("output_index")
        if kind == "response.output_item.added":
            output.append(copy.deepcopy(event["item"]))
        elif kind == "response.content_part.added":
            output[index]["content"].append(copy.deepcopy(event["part"]))
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta"):
            part = output[index]["content"][event["content_index"]]
            part["text"] += event["delta"]
            part.get("logprobs", []).extend(event.get("logprobs", []))
        elif kind == "response.function_call_arguments.delta":
            output[index]["arguments"] += event["delta"]
        elif kind == "response.output_item.done":
            output[index]["status"] = event["item"]["status"]
    return output


def assert_stream_equals_response(builder: ResponsesBuilder, chunks: list[SSEChunk]) -> None:
    whole = builder.response()
    assert rebuilt_output(chunks) == whole["output"]
    done = [c.data["item"] for c in chunks if c.data["type"] == "response.output_item.done"]
    assert done == whole["output"]
    assert chunks[-1].data["response"] == whole
    expected = Response.model_validate(copy.deepcopy(whole))
    assert sdk_final(chunks).model_dump(exclude_none=True) == expected.model_dump(exclude_none=True)


def test_plain_text() -> None:
    builder, chunks = run([ContentDelta("Hel"), ContentDelta("lo")])
    assert types(chunks) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    events = sdk_events(chunks)
    assert events[0].response.status == "in_progress"
    assert events[0].response.output == []
    assert events[0].response.usage is None
    assert [e.delta for e in events[4:6]] == ["Hel", "lo"]
    assert events[6].text == "Hello"
    whole = Response.model_validate(builder.response())
    assert whole.status == "completed"
    assert whole.output_text == "Hello"
    assert whole.output[0].type == "message"
    assert whole.output[0].status == "completed"
    assert whole.usage is not None
    assert (whole.usage.input_tokens, whole.usage.output_tokens, whole.usage.total_tokens) == (
        12,
        9,
        21,
    )
    assert whole.usage.input_tokens_details.cached_tokens == 4
    assert whole.usage.output_tokens_details.reasoning_tokens == 3
    assert whole.completed_at is not None
    assert_stream_equals_response(builder, chunks)


def test_reasoning_then_content() -> None:
    builder, chunks = run([ReasoningDelta("think "), ReasoningDelta("more"), ContentDelta("42")])
    assert types(chunks)[2:11] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
    ]
    whole = Response.model_validate(builder.response())
    reasoning, message = whole.output
    assert reasoning.type == "reasoning"
    assert reasoning.content[0].text == "think more"
    assert reasoning.summary == []
    assert message.content[0].text == "42"
    assert chunks[12].data["output_index"] == 1
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
    builder, chunks = run(TWO_CALLS, kind="tool_calls", request=body(tools=[WEATHER]))
    deltas = [c.data for c in chunks if c.data["type"] == "response.function_call_arguments.delta"]
    assert [(d["output_index"], d["delta"]) for d in deltas] == [
        (1, '{"city": '),
        (1, '"Oslo"}'),
        (2, "{}"),
    ]
    done = [c.data for c in chunks if c.data["type"] == "response.function_call_arguments.done"]
    assert [d["arguments"] for d in done] == ['{"city": "Oslo"}', "{}"]
    whole = Response.model_validate(builder.response())
    message, first, second = whole.output
    assert message.content[0].text == "Checking."
    assert (first.call_id, first.name, first.arguments) == ("call_a", "weather", '{"city": "Oslo"}')
    assert (second.call_id, second.name, second.arguments) == ("call_b", "clock", "{}")
    assert first.id.startswith("fc_") and first.id != second.id
    assert whole.status == "completed"
    assert whole.tools[0].name == "weather"
    assert_stream_equals_response(builder, chunks)


def test_length_ends_incomplete() -> None:
    builder, chunks = run([ContentDelta("cut")], kind="length")
    assert types(chunks)[-1] == "response.incomplete"
    whole = Response.model_validate(builder.response())
    assert whole.status == "incomplete"
    assert whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output[0].status == "incomplete"
    assert whole.completed_at is None
    assert_stream_equals_response(builder, chunks)


def test_stop_sequence_completes_and_abort_is_incomplete_without_reason() -> None:
    builder, chunks = run([ContentDelta("a")], kind="stop_sequence")
    assert Response.model_validate(builder.response()).status == "completed"
    assert_stream_equals_response(builder, chunks)
    builder, chunks = run([ContentDelta("a")], kind="abort")
    whole = Response.model_validate(builder.response())
    assert (whole.status, whole.incomplete_details.reason) == ("incomplete", None)


def test_empty_generation_still_has_an_empty_message() -> None:
    builder, chunks = run([])
    whole = Response.model_validate(builder.response())
    assert [item.type for item in whole.output] == ["message"]
    assert whole.output_text == ""
    assert_stream_equals_response(builder, chunks)


def lp(token: str, logprob: float) -> LogprobEntry:
    return LogprobEntry(
        token, list(token.encode()), logprob, [(token, list(token.encode()), logprob)]
    )


def test_logprobs_for_answer_text() -> None:
    steps: list[Step] = [
        (ReasoningDelta("hm"), [lp("hm", -0.5)]),
        (ContentDelta("Hi"), [lp("H", -0.1), lp("i", -0.2)]),
    ]
    request = body(include=["message.output_text.logprobs"], top_logprobs=1)
    builder, chunks = run(steps, request=request)
    delta = next(c.data for c in chunks if c.data["type"] == "response.output_text.delta")
    assert [entry["token"] for entry in delta["logprobs"]] == ["H", "i"]
    whole = Response.model_validate(builder.response())
    logprobs = whole.output[1].content[0].logprobs
    assert [(e.token, e.logprob, e.bytes) for e in logprobs] == [
        ("H", -0.1, [72]),
        ("i", -0.2, [105]),
    ]
    assert whole.top_logprobs == 1
    assert_stream_equals_response(builder, chunks)


def test_logprobs_not_requested_are_not_reported() -> None:
    builder, chunks = run([(ContentDelta("Hi"), [lp("Hi", -0.1)])])
    delta = next(c.data for c in chunks if c.data["type"] == "response.output_text.delta")
    assert delta["logprobs"] == []


def test_response_echoes_the_request() -> None:
    request = body(
        instructions="be brief",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=64,
        temperature=0.3,
        top_p=0.8,
        metadata={"k": "v"},
        user="u1",
        parallel_tool_calls=False,
        reasoning={"effort": "low"},
        text={"format": {"type": "json_object"}},
        store=True,
    )
    builder, _ = run([ContentDelta("{}")], request=request)
    whole = Response.model_validate(builder.response())
    assert (whole.id, whole.object, whole.model, whole.created_at) == (
        "resp_1",
        "response",
        "m",
        1_700_000_000,
    )
    assert whole.instructions == "be brief"
    assert whole.tool_choice == "required"
    assert whole.tools[0].strict is True
    assert (whole.max_output_tokens, whole.temperature, whole.top_p) == (64, 0.3, 0.8)
    assert (whole.metadata, whole.user, whole.parallel_tool_calls) == ({"k": "v"}, "u1", False)
    assert whole.reasoning is not None and whole.reasoning.effort == "low"
    assert whole.text is not None and whole.text.format.type == "json_object"
    assert whole.store is True  # kept, as asked (the route stores it)
    assert whole.previous_response_id is None


def test_named_tool_choice_and_json_schema_are_echoed_in_their_shapes() -> None:
    request = body(
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "weather"},
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
    )
    builder, _ = run([ContentDelta("{}")], request=request)
    whole = Response.model_validate(builder.response())
    assert whole.tool_choice.type == "function" and whole.tool_choice.name == "weather"
    assert whole.text.format.type == "json_schema" and whole.text.format.name == "w"


def test_events_do_not_change_after_they_are_returned() -> None:
    builder = ResponsesBuilder(parse(body()), CONTEXT)
    builder.start(Usage())
    added = builder.delta(ContentDelta("a"))
    snapshot = copy.deepcopy([chunk.data for chunk in added])
    builder.delta(ContentDelta("b"))
    builder.finish("stop", Usage(), None)
    assert [chunk.data for chunk in added] == snapshot


def test_stream_error_sends_error_then_failed() -> None:
    builder = ResponsesBuilder(parse(body()), CONTEXT)
    chunks = builder.start(Usage()) + builder.delta(ContentDelta("a"))
    chunks += builder.stream_error(ApiError(500, "engine failed", "server_error"))
    events = sdk_events(chunks)
    assert types(chunks)[-2:] == ["error", "response.failed"]
    assert events[-2].message == "engine failed"
    failed = events[-1].response
    assert failed.status == "failed"
    assert (failed.error.code, failed.error.message) == ("server_error", "engine failed")
