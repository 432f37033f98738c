"""Structured outputs and forced tool calls through the official SDKs, on the default model.

The SDKs' own ``parse`` helpers are the clients: a pydantic model goes in as
a strict JSON schema and must come back as a parsed object, greedy and
sampled, on every protocol. Forced tool calls must carry arguments that
validate against the function's schema, streamed or not.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import httpx
import jsonschema
import llguidance
import pytest
from anthropic import Anthropic
from openai import OpenAI
from pydantic import BaseModel, ConfigDict, Field

from shared.constraints import grammar_of, lltokenizer
from shared.registry import smollm2_gguf_path
from shared.sampling import StructuredOutputs
from shared.tokenizer_loader import load_tokenizer

pytestmark = pytest.mark.slow
MAX_TOKENS = 200


class Closed(BaseModel):
    """No properties beyond the declared ones (the openai SDK's strict schemas say so too)."""

    model_config = ConfigDict(extra="forbid")


class Person(Closed):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    email: str | None = Field(default=None, max_length=40)


class Recipe(Closed):
    title: str = Field(max_length=40)
    ingredients: list[Annotated[str, Field(max_length=24)]] = Field(max_length=4)
    minutes: int = Field(ge=1, le=600)


class Weather(Closed):
    city: str = Field(max_length=30)
    unit: Literal["celsius", "fahrenheit"]
    temperature: float


class Item(Closed):
    sku: str = Field(max_length=12)
    quantity: int = Field(ge=1, le=99)


class Customer(Closed):
    name: str = Field(max_length=24)
    vip: bool


class Order(Closed):
    customer: Customer
    items: list[Item] = Field(max_length=3)
    status: Literal["pending", "shipped", "delivered"]


CASES: list[tuple[type[BaseModel], str]] = [
    (Person, "Invent a person named Ada."),
    (Person, "Describe a fictional programmer."),
    (Person, "Who could be my neighbour?"),
    (Person, "Make up a teacher, with an email address."),
    (Person, "A retired sailor."),
    (Recipe, "A recipe for pancakes."),
    (Recipe, "How do I make tomato soup?"),
    (Recipe, "Give me a quick salad."),
    (Recipe, "A dessert with chocolate."),
    (Recipe, "Breakfast in ten minutes."),
    (Weather, "What is the weather in Paris?"),
    (Weather, "Report the weather in Boston in fahrenheit."),
    (Weather, "Is it cold in Oslo?"),
    (Weather, "Weather for Tokyo today."),
    (Weather, "How hot is Cairo?"),
    (Order, "An order of two books for Bob."),
    (Order, "Alice, a VIP, ordered a lamp; it shipped."),
    (Order, "A pending order of three pens."),
    (Order, "Record a delivered order for Carol."),
    (Order, "Make up an order."),
]
SAMPLINGS = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 1.0, "seed": 7}}
# Each route takes a share of the cases, every schema in each share: the even cases greedy
# and the odd ones sampled through chat, and every fourth through Responses and Messages.
CHAT_CASES = {"greedy": CASES[::2], "sampled": CASES[1::2]}


def _in_parallel(function, items):
    with ThreadPoolExecutor(4) as pool:  # the server runs four sequences at once
        return list(pool.map(function, items))


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_chat_parse_returns_every_object(openai_client: OpenAI, sampling: str) -> None:
    def ask(case: tuple[type[BaseModel], str]) -> object:
        model, prompt = case
        completion = openai_client.chat.completions.parse(
            model="default",
            messages=[{"role": "user", "content": prompt}],
            response_format=model,
            max_tokens=MAX_TOKENS,
            **SAMPLINGS[sampling],
        )
        return completion.choices[0].message.parsed

    cases = CHAT_CASES[sampling]
    for (model, _), parsed in zip(cases, _in_parallel(ask, cases), strict=True):
        assert isinstance(parsed, model)


def test_responses_parse_returns_every_object(openai_client: OpenAI) -> None:
    def ask(case: tuple[type[BaseModel], str]) -> object:
        model, prompt = case
        response = openai_client.responses.parse(
            model="default",
            input=prompt,
            text_format=model,
            max_output_tokens=MAX_TOKENS,
            temperature=0.0,
        )
        return response.output_parsed

    cases = CASES[::4]
    for (model, _), parsed in zip(cases, _in_parallel(ask, cases), strict=True):
        assert isinstance(parsed, model)


def test_messages_output_format_returns_every_object(anthropic_client: Anthropic) -> None:
    """``output_config.format`` with each model's own schema (bounds included), read back by it.

    ``messages.parse`` would move maxLength and maxItems into descriptions (the
    hosted API does not enforce them), leaving the model strings to run on.
    """

    def ask(case: tuple[type[BaseModel], str]) -> object:
        model, prompt = case
        message = anthropic_client.messages.create(
            model="default",
            messages=[{"role": "user", "content": prompt}],
            output_config={"format": {"type": "json_schema", "schema": model.model_json_schema()}},
            max_tokens=MAX_TOKENS,
            extra_body={"temperature": 0.0},  # this SDK version no longer takes it by name
        )
        assert message.stop_reason == "end_turn"
        return model.model_validate_json(message.content[0].text)

    cases = CASES[1::4]
    for (model, _), parsed in zip(cases, _in_parallel(ask, cases), strict=True):
        assert isinstance(parsed, model)


def test_json_object_outputs_parse(openai_client: OpenAI) -> None:
    prompts = [
        "What is 2+2? Answer in JSON with the key answer.",
        "Return a JSON object with a city and its country.",
        "A person with a name and an age, in JSON.",
    ]

    def ask(prompt: str) -> str:
        completion = openai_client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": prompt}],
            response_format={"type": "json_object"},
            max_tokens=MAX_TOKENS,
            temperature=0.0,
        )
        assert completion.choices[0].finish_reason == "stop"
        return completion.choices[0].message.content or ""

    for content in _in_parallel(ask, prompts):
        assert isinstance(json.loads(content), dict)


def _extra(openai_client: OpenAI, prompt: str, structured: dict, **kwargs) -> str:
    completion = openai_client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=60,
        extra_body={"structured_outputs": structured},
        **{"temperature": 0.0, **kwargs},
    )
    return completion.choices[0].message.content or ""


def test_regex_choice_and_grammar_through_structured_outputs(openai_client: OpenAI) -> None:
    pattern = r"\d{3}-\d{4}"
    assert re.fullmatch(pattern, _extra(openai_client, "A phone number?", {"regex": pattern}))
    choices = ["positive", "negative", "neutral"]
    assert _extra(openai_client, "I love it!", {"choice": choices}) in choices

    lark = (
        'start: "Colour: " COLOUR ", count: " NUMBER\nCOLOUR: /[a-z]{3,8}/\nNUMBER: /[1-9][0-9]?/'
    )
    text = _extra(openai_client, "Pick a colour and a count.", {"grammar": lark})
    tokenizer = load_tokenizer(smollm2_gguf_path())
    llg = lltokenizer(tokenizer)
    matcher = llguidance.LLMatcher(llg, grammar_of(StructuredOutputs(grammar=lark)))
    assert matcher.consume_tokens(llg.tokenize_str(text)) and matcher.is_accepting(), text


def test_sampled_regex_is_a_full_match_every_time(openai_client: OpenAI) -> None:
    pattern = r"(yes|no), because [a-z ]{1,30}\."
    for seed in range(4):
        text = _extra(openai_client, "Is water wet?", {"regex": pattern}, seed=seed, temperature=1)
        assert re.fullmatch(pattern, text), text


WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME_TOOL = {
    "name": "get_time",
    "description": "The local time in a time zone.",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 30}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
SCHEMAS = {tool["name"]: tool["parameters"] for tool in (WEATHER_TOOL, TIME_TOOL)}
OPENAI_TOOLS = [
    {"type": "function", "function": {**tool, "strict": True}} for tool in (WEATHER_TOOL, TIME_TOOL)
]


def _openai_calls(openai_client: OpenAI, tool_choice, stream: bool) -> tuple[list, str | None]:
    kwargs = {
        "model": "default",
        "messages": [{"role": "user", "content": "Hello! How are you today?"}],
        "tools": OPENAI_TOOLS,
        "tool_choice": tool_choice,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
    }
    if not stream:
        choice = openai_client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return calls, choice.finish_reason
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in openai_client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0] if chunk.choices else None
        if choice is None:
            continue
        for call in choice.delta.tool_calls or []:
            if call.function and call.function.name:
                names[call.index] = call.function.name
            if call.function and call.function.arguments:
                arguments[call.index] = arguments.get(call.index, "") + call.function.arguments
        finish = choice.finish_reason or finish
    return [(names[i], arguments.get(i, "")) for i in sorted(names)], finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_forced_openai_tool_calls_validate(
    openai_client: OpenAI, tool_choice, stream: bool
) -> None:
    calls, finish = _openai_calls(openai_client, tool_choice, stream)
    assert calls and finish == "tool_calls"
    if isinstance(tool_choice, dict):  # a named function is called once
        assert [name for name, _ in calls] == ["get_time"]
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}], ids=["any", "tool"]
)
def test_forced_anthropic_tool_calls_validate(
    anthropic_client: Anthropic, tool_choice: dict, stream: bool
) -> None:
    one_call = tool_choice["type"] == "tool" or stream
    if stream and tool_choice["type"] == "any":  # streamed, the one-call form of "any"
        tool_choice = {**tool_choice, "disable_parallel_tool_use": True}
    kwargs = {
        "model": "default",
        "max_tokens": MAX_TOKENS,
        "extra_body": {"temperature": 0.0},
        "messages": [{"role": "user", "content": "Tell me a joke."}],
        "tools": [
            {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
            for t in (WEATHER_TOOL, TIME_TOOL)
        ],
        "tool_choice": tool_choice,
    }
    if stream:
        with anthropic_client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = anthropic_client.messages.create(**kwargs)
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses and message.stop_reason == "tool_use"
    if one_call:
        assert len(uses) == 1
    if tool_choice["type"] == "tool":  # a named tool is called once
        assert [use.name for use in uses] == ["get_weather"]
    for use in uses:
        jsonschema.validate(use.input, SCHEMAS[use.name])


def test_one_call_when_parallel_tool_calls_is_false(openai_client: OpenAI) -> None:
    completion = openai_client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Weather in Paris and the time in Tokyo?"}],
        tools=OPENAI_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
    )
    assert len(completion.choices[0].message.tool_calls or []) == 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"if": {}}}},
                    },
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"logit_bias": {"99999999": 5}}, "logit_bias"),
        ({"logit_bias": {"1": 500}}, "logit_bias"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_a_constraint_the_engine_refuses_is_a_400_naming_the_field(
    http: httpx.Client, body: dict, param: str
) -> None:
    reply = http.post(
        "/v1/chat/completions",
        json={"model": "default", "messages": [{"role": "user", "content": "Hi"}], **body},
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_an_unenforceable_anthropic_format_is_a_400(http: httpx.Client) -> None:
    reply = http.post(
        "/v1/messages",
        json={
            "model": "default",
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "Hi"}],
            "output_config": {
                "format": {
                    "type": "json_schema",
                    "schema": {"type": "string", "format": "no-such-format"},
                }
            },
        },
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert "no-such-format" in reply.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        ),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 16}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ],
)
def test_an_unknown_field_is_reported_as_ignored(http: httpx.Client, path: str, body: dict):
    body = {"model": "default", **body}
    reply = http.post(path, json={**body, "no_such": 1})
    assert reply.status_code == 200, reply.text
    assert reply.headers["sluice-ignored-fields"] == "no_such"
    known = http.post(path, json=body)
    assert "sluice-ignored-fields" not in known.headers
