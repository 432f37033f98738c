"""``/openapi.json`` documents a request body for every POST route that takes one.

The handlers read their bodies themselves, so these schemas are documentation: what
a client relies on is that each is there, that the official ``openai`` and
``anthropic`` SDKs' requests fit it (checked with the route's pydantic model and,
independently, with ``jsonschema`` against the published document), that a body of
the wrong shape does not, and that the protocols' readers agree with both.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any, get_args

import anthropic
import jsonschema
import openai
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute, iter_route_contexts
from fastapi.testclient import TestClient
from pydantic import BaseModel, ValidationError

try:  # newer SDKs run on their own fork of httpx, with the same API
    import httpx2 as sdk_http
except ImportError:
    import httpx as sdk_http

from api.app import create_app
from api.batches.anthropic_batches import MessageBatchCreate
from api.batches.openai_batches import ENDPOINTS, BatchCreate
from api.errors import ApiError
from api.info_routes import DetokenizeRequest, TokenizeRequest
from api.jobs.routes import JobBatch, JobSubmission
from api.openapi_bodies import REF_PREFIX
from api.protocols import chat_completions, completions, messages, responses
from api.protocols.messages_schema import CountTokensBody
from api.protocols.table import BY_PATH, PROTOCOLS
from api.settings import Settings
from tests.image_server import png_bytes
from tests.jobs.conftest import PacedBackend

# POST routes that take no body.
NO_BODY = {
    "/v1/responses/{response_id}/cancel",
    "/v1/batches/{batch_id}/cancel",
    "/v1/messages/batches/{batch_id}/cancel",
}
MODELS: dict[str, type[BaseModel]] = {
    **{protocol.path: protocol.request_model for protocol in PROTOCOLS},
    messages.COUNT_TOKENS_PATH: CountTokensBody,
    "/v1/batches": BatchCreate,
    "/v1/messages/batches": MessageBatchCreate,
    "/v1/jobs": JobSubmission,
    "/v1/jobs/batch": JobBatch,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
FORMS = {"/v1/files"}  # multipart/form-data; every other body is JSON
READERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    **{protocol.path: protocol.parse for protocol in PROTOCOLS},
    messages.COUNT_TOKENS_PATH: messages.parse_count_tokens,
}
PNG = base64.b64encode(png_bytes(8, 8)).decode()
DATA_URL = f"data:image/png;base64,{PNG}"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}


@pytest.fixture(scope="module")
def app() -> FastAPI:
    return create_app(Settings(), backend=PacedBackend())


@pytest.fixture(scope="module")
def document(app: FastAPI) -> dict[str, Any]:
    return app.openapi()


def _resolve(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].removeprefix(REF_PREFIX)]
    return schema


def _body_schema(document: dict[str, Any], path: str) -> tuple[str, dict[str, Any]]:
    """The media type and schema of ``path``'s documented POST body."""
    body = document["paths"][path]["post"]["requestBody"]
    assert body["required"] is True
    ((media_type, media),) = body["content"].items()
    return media_type, media["schema"]


def _validate_published(document: dict[str, Any], path: str, body: Any) -> None:
    """``body`` against the schema published for ``path``, read by ``jsonschema`` alone."""
    _, schema = _body_schema(document, path)
    root = {**schema, "components": document["components"]}
    jsonschema.Draft202012Validator(root).validate(body)


def _is_object(document: dict[str, Any], schema: dict[str, Any]) -> bool:
    """An object schema with properties, or a union of those (or of arrays of those)."""
    schema = _resolve(document, schema)
    if "anyOf" in schema or "oneOf" in schema:
        return all(
            _is_object(document, member) for member in schema.get("anyOf", schema.get("oneOf"))
        )
    if schema.get("type") == "array":
        return _is_object(document, schema["items"])
    return schema.get("type") == "object" and bool(schema.get("properties"))


# --- every body is documented ----------------------------------------------------------


def test_every_post_route_with_a_body_documents_an_object_schema(
    app: FastAPI, document: dict[str, Any]
) -> None:
    posts = [
        route
        for route in iter_route_contexts(app.routes)  # included routers' routes too
        if isinstance(route.original_route, APIRoute) and "POST" in (route.methods or ())
    ]
    assert len(posts) >= 15
    for route in posts:
        operation = document["paths"][route.path]["post"]
        if route.path in NO_BODY:
            assert "requestBody" not in operation, route.path
            continue
        assert "requestBody" in operation, f"{route.path} documents no request body"
        media_type, schema = _body_schema(document, route.path)
        form = route.path in FORMS
        assert media_type == ("multipart/form-data" if form else "application/json"), route.path
        assert _is_object(document, schema), route.path
    assert {route.path for route in posts} >= NO_BODY


def test_the_served_document_is_the_one_checked_here(
    app: FastAPI, document: dict[str, Any]
) -> None:
    """``/openapi.json`` serves ``app.openapi()``, under a proxy's root path too."""
    served = TestClient(app, root_path="/llm").get("/openapi.json").json()
    assert served["servers"] == [{"url": "/llm"}]
    assert served["paths"] == document["paths"]
    assert served["components"] == document["components"]


def test_every_documented_example_fits_its_schema(document: dict[str, Any]) -> None:
    """The example ``/docs`` fills a form with is a body the schema accepts."""
    examples = 0
    for path, operations in document["paths"].items():
        body = operations.get("post", {}).get("requestBody")
        if body is None:
            continue
        for media in body["content"].values():
            if "example" in media:
                _validate_published(document, path, media["example"])
                if path in MODELS:
                    MODELS[path].model_validate(media["example"])
                examples += 1
    assert examples >= len(MODELS)


def test_the_endpoints_a_job_or_batch_names_are_the_served_ones() -> None:
    assert set(get_args(JobSubmission.model_fields["endpoint"].annotation)) == set(BY_PATH)
    assert set(get_args(BatchCreate.model_fields["endpoint"].annotation)) == set(ENDPOINTS)


# --- the SDKs' requests fit -------------------------------------------------------------


def _recorder(bodies: list[tuple[str, Any]]) -> sdk_http.Client:
    """The SDKs' HTTP client, recording each request's path and JSON body; every answer is
    a minimal object, which the SDKs take without checking it."""

    def answer(request: sdk_http.Request) -> sdk_http.Response:
        bodies.append((request.url.path, json.loads(request.content)))
        return sdk_http.Response(200, json={"id": "x", "type": "message", "content": []})

    return sdk_http.Client(transport=sdk_http.MockTransport(answer))


def _openai_requests(client: openai.OpenAI) -> None:
    chat_tool = {
        "type": "function",
        "function": {"name": "weather", "description": "The weather", "parameters": WEATHER},
    }
    client.chat.completions.create(
        model="default",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this, and the weather in Paris?"},
                    {"type": "image_url", "image_url": {"url": DATA_URL, "detail": "low"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        ],
        tools=[chat_tool],
        tool_choice={"type": "function", "function": {"name": "weather"}},
        parallel_tool_calls=False,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": WEATHER, "strict": True},
        },
        stream=True,
        stream_options={"include_usage": True},
        n=1,
        seed=7,
        logprobs=True,
        top_logprobs=3,
        stop=["\n\n", "END"],
        max_completion_tokens=64,
        max_tokens=64,
        reasoning_effort="low",
        metadata={"ticket": "42"},
        user="someone",
        logit_bias={"15": -100, "16": 2},
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.1,
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "ignore_eos": False,
            "stop_token_ids": [2],
            "skip_special_tokens": True,
            "priority": 1,
        },
    ).close()
    client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Yes or no?"}],
        response_format={"type": "json_object"},
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    client.completions.create(
        model="default", prompt=[1, 2, 3], echo=True, logprobs=2, max_tokens=0, best_of=1
    )
    client.completions.create(model="default", prompt=[[4, 5, 6]], suffix="", stop="\n")
    client.responses.create(
        model="default",
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "Hi"},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {"type": "input_image", "image_url": DATA_URL, "detail": "auto"},
                ],
            },
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Look it up."}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
        ],
        tools=[
            {
                "type": "function",
                "name": "weather",
                "description": "The weather",
                "parameters": WEATHER,
                "strict": True,
            }
        ],
        tool_choice="auto",
        text={"format": {"type": "json_schema", "name": "answer", "schema": WEATHER}},
        reasoning={"effort": "medium"},
        max_output_tokens=64,
        store=False,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        metadata={"ticket": "42"},
        temperature=0.5,
        parallel_tool_calls=True,
    )
    client.responses.create(model="default", input="Hi", previous_response_id="resp_1")
    client.batches.create(
        input_file_id="file-1",
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"run": "nightly"},
        output_expires_after={"anchor": "created_at", "seconds": 86_400},
    )


def _anthropic_requests(client: anthropic.Anthropic) -> None:
    tool = {"name": "weather", "description": "The weather", "input_schema": WEATHER}
    turns = [
        {
            "role": "user",
            "content": [
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": PNG},
                },
                {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
                {"type": "text", "text": "What are these, and the weather in Paris?"},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Look it up.", "signature": "sig"},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}],
        },
    ]
    client.messages.create(
        model="default",
        max_tokens=2048,
        system="Be brief.",
        messages=turns,
        tools=[tool],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        thinking={"type": "enabled", "budget_tokens": 1024},
        stop_sequences=["END"],
        metadata={"user_id": "someone"},
        extra_body={"temperature": 1.0},  # older SDKs' own parameter
    )
    client.messages.create(
        model="default",
        max_tokens=64,
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
        output_config={
            "effort": "low",
            "format": {"type": "json_schema", "schema": WEATHER},
        },
        extra_body={"top_k": 20, "top_p": 0.9},
    )
    client.messages.count_tokens(
        model="default",
        system=[{"type": "text", "text": "Be brief."}],
        messages=turns,
        tools=[tool],
        tool_choice={"type": "tool", "name": "weather"},
    )
    client.messages.batches.create(
        requests=[
            {
                "custom_id": "first-1",
                "params": {"model": "default", "max_tokens": 64, "messages": turns},
            }
        ]
    )


@pytest.fixture(scope="module")
def sdk_bodies() -> list[tuple[str, Any]]:
    bodies: list[tuple[str, Any]] = []
    with _recorder(bodies) as http_client:
        _openai_requests(
            openai.OpenAI(
                api_key="sk-test",
                base_url="http://sluice.test/v1",
                http_client=http_client,
                max_retries=0,
            )
        )
        _anthropic_requests(
            anthropic.Anthropic(
                api_key="sk-test",
                base_url="http://sluice.test",
                http_client=http_client,
                max_retries=0,
            )
        )
    return bodies


def test_the_sdks_requests_fit_the_route_models_and_the_published_schemas(
    sdk_bodies: list[tuple[str, Any]], document: dict[str, Any]
) -> None:
    assert {path for path, _ in sdk_bodies} == set(READERS) | {
        "/v1/batches",
        "/v1/messages/batches",
    }
    for path, body in sdk_bodies:
        MODELS[path].model_validate(body)
        _validate_published(document, path, body)


def test_the_readers_accept_the_sdks_requests(sdk_bodies: list[tuple[str, Any]]) -> None:
    """The documented bodies are served: each protocol's reader takes them."""
    for path, body in sdk_bodies:
        if path in READERS:
            READERS[path](body)


# --- a body of the wrong shape does not fit ---------------------------------------------


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "default", "messages": [{"role": "user", "content": "Hi"}], **fields}


def _messages(**fields: Any) -> dict[str, Any]:
    return {"max_tokens": 16, **_chat(**fields)}


WRONG: list[tuple[str, dict[str, Any]]] = [
    (chat_completions.PROTOCOL.path, _chat(messages="Hi")),
    (chat_completions.PROTOCOL.path, _chat(messages=[{"role": "robot", "content": "Hi"}])),
    (chat_completions.PROTOCOL.path, _chat(messages=[{"role": "user", "content": 3}])),
    (
        chat_completions.PROTOCOL.path,
        _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
    ),
    (chat_completions.PROTOCOL.path, _chat(tools={"type": "function"})),
    (chat_completions.PROTOCOL.path, _chat(tool_choice="sometimes")),
    (chat_completions.PROTOCOL.path, _chat(response_format={"type": "xml"})),
    (chat_completions.PROTOCOL.path, _chat(temperature="hot")),
    (chat_completions.PROTOCOL.path, _chat(reasoning_effort="extreme")),
    (chat_completions.PROTOCOL.path, _chat(stream_options=True)),
    (completions.PROTOCOL.path, {"model": "default", "prompt": {"text": "Hi"}}),
    (completions.PROTOCOL.path, {"model": "default", "prompt": [1, "two"]}),
    (completions.PROTOCOL.path, {"model": "default"}),
    (responses.PROTOCOL.path, {"model": "default", "input": 3}),
    (responses.PROTOCOL.path, {"model": "default", "input": [{"type": "function_call"}]}),
    (responses.PROTOCOL.path, {"model": "default", "input": "Hi", "text": {"format": "json"}}),
    (messages.PROTOCOL.path, _messages(messages="Hi")),
    (messages.PROTOCOL.path, _messages(messages=[{"role": "user", "content": [{"type": "x"}]}])),
    (messages.PROTOCOL.path, _messages(thinking={"type": "enabled", "budget_tokens": 10})),
    (messages.COUNT_TOKENS_PATH, {"model": "default", "messages": []}),
]


@pytest.mark.parametrize(("path", "body"), WRONG)
def test_a_body_of_the_wrong_shape_fits_neither_model_nor_schema_nor_reader(
    path: str, body: dict[str, Any], document: dict[str, Any]
) -> None:
    with pytest.raises(ValidationError):
        MODELS[path].model_validate(body)
    with pytest.raises(jsonschema.ValidationError):
        _validate_published(document, path, body)
    with pytest.raises(ApiError) as refused:
        READERS[path](body)
    assert refused.value.status == 400


JOB = {"endpoint": "/v1/completions", "body": {"model": "default", "prompt": "Hi"}}
WRONG_ENVELOPES: list[tuple[str, Any]] = [
    ("/v1/jobs", {**JOB, "endpoint": "/v1/embeddings"}),
    ("/v1/jobs", {**JOB, "body": "Hi"}),
    ("/v1/jobs/batch", {"jobs": []}),
    ("/v1/jobs/batch", [{**JOB, "metadata": {"n": 1}}]),
    ("/tokenize", {"prompt": {"text": "Hi"}}),
    ("/tokenize", {"messages": "Hi"}),
    ("/detokenize", {"tokens": "Hi"}),
    ("/v1/batches", {"input_file_id": "file-1", "endpoint": "/v1/chat/completions"}),
    ("/v1/batches", {"input_file_id": "f", "endpoint": "/v1/completions", "window": "24h"}),
    ("/tokenize", {"prompt": "Hi", "stream": True}),
    ("/v1/messages/batches", {"requests": [{"custom_id": "a b", "params": _messages()}]}),
    ("/v1/messages/batches", {"requests": [{"custom_id": "a", "params": {"model": "m"}}]}),
]


@pytest.mark.parametrize(("path", "body"), WRONG_ENVELOPES)
def test_an_envelope_of_the_wrong_shape_fits_neither_model_nor_schema(
    path: str, body: Any, document: dict[str, Any]
) -> None:
    with pytest.raises(ValidationError):
        MODELS[path].model_validate(body)
    with pytest.raises(jsonschema.ValidationError):
        _validate_published(document, path, body)


def test_the_models_allow_fields_they_do_not_name() -> None:
    """Unknown fields are the readers' to report or refuse (``api.protocols.unsupported``)."""
    chat_completions.PROTOCOL.request_model.model_validate(_chat(store=False, verbosity="low"))
    responses.PROTOCOL.request_model.model_validate(
        {"model": "default", "input": "Hi", "truncation": "disabled"}
    )
