"""The routes that answer about the server rather than generate: its models, its version,
and the token ids a prompt becomes.

``/tokenize`` and ``/detokenize`` have vLLM's shapes: a ``prompt`` (read as
Completions reads it) or ``messages`` (read as Chat Completions reads them) in,
``tokens``, ``count`` and ``max_model_len`` out; ``model`` may be left out when one
model is served. Text that spells a special token stays text, as in every prompt
Sluice tokenizes, where vLLM's ``/tokenize`` reads the token. ``/v1/tokenize`` keeps
Sluice's own shape: a Chat Completions body in, the rendered prompt with its
special-token ranges out.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Field, RootModel

from api.errors import bad_request, not_found
from api.openapi_bodies import json_body
from api.preparation import encode_request, resolve_model
from api.protocols import chat_completions, completions
from api.protocols.body_validation import openai_error, validated
from api.protocols.chat_completions_request import (
    ChatCompletionRequest,
    ChatFunctionTool,
    ChatMessage,
)
from api.protocols.completions_request import Prompts
from api.protocols.openai_request_parts import ClosedBody, NonEmptyString, integer
from api.serving import Serving
from shared.registry import ModelSpec
from shared.version import package_version

_MODEL = Field(None, description="A served model; may be left out when one is served.")
_TOKEN_STRS = Field(None, description="Also answer each token's string.")


class TokenizePrompt(ClosedBody):
    """A prompt, read as ``/v1/completions`` reads it; ``return_token_strs`` is the route's."""

    model: NonEmptyString | None = _MODEL
    prompt: Prompts
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = _TOKEN_STRS


class TokenizeMessages(ClosedBody):
    """Messages, read as ``/v1/chat/completions`` reads them; ``return_token_strs`` is the
    route's."""

    model: NonEmptyString | None = _MODEL
    # at least one message: the Chat Completions parser refuses an empty list with its message
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatFunctionTool] | None = None
    return_token_strs: bool | None = _TOKEN_STRS


class TokenizeRequest(RootModel[TokenizePrompt | TokenizeMessages]):
    """``POST /tokenize``: either a ``prompt`` or ``messages``."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"prompt": "Hello world"}]})


class DetokenizeRequest(ClosedBody):
    """``POST /detokenize``: token ids to decode."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"tokens": [1, 2, 3]}]})

    model: NonEmptyString | None = _MODEL
    tokens: list[integer(low=0)]


def info_router(serving: Serving) -> APIRouter:
    router = APIRouter()
    created = int(time.time())

    def model_object(spec: ModelSpec) -> dict[str, Any]:
        """OpenAI's model object, with its aliases (names it also answers to), the entry it
        serves as vLLM's ``root`` and, once loaded, vLLM's ``max_model_len``."""
        loaded = {model.spec.name: model.context_length for model in serving.backend.models()}
        return {
            "id": spec.served_name,
            "object": "model",
            "created": created,
            "owned_by": "sluice",
            "root": spec.name,
            "aliases": list(spec.public_names[1:]),
            "max_model_len": loaded.get(spec.name) or spec.context_length or None,
        }

    @router.get("/v1/models")
    async def list_models() -> Response:
        """OpenAI's list shape, each served model once."""
        data = [model_object(spec) for spec in serving.registry.specs()]
        return JSONResponse({"object": "list", "data": data})

    @router.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> Response:
        """One served model, by its name or an alias; 404 in OpenAI's shape otherwise."""
        if model not in serving.registry.names():
            raise not_found(f"The model '{model}' does not exist", "model")
        return JSONResponse(model_object(serving.registry.resolve(model)))

    @router.get("/version")
    async def server_version() -> Response:
        return JSONResponse({"version": package_version()})

    for path, route, model in (
        ("/v1/tokenize", _chat_tokenize(serving), ChatCompletionRequest),
        ("/tokenize", _tokenize(serving), TokenizeRequest),
        ("/detokenize", _detokenize(serving), DetokenizeRequest),
    ):
        router.add_api_route(path, route, methods=["POST"], openapi_extra=json_body(model))
    return router


def _chat_tokenize(serving: Serving) -> Callable[..., Awaitable[Response]]:
    async def chat_tokenize(request: Request) -> Response:
        """A Chat Completions body → the exact prompt and token ids the model would get."""
        parsed = chat_completions.PROTOCOL.parse(await serving.read_json(request))
        encoded = await serving.off_loop(encode_request, parsed, serving.context())
        return JSONResponse(
            {
                "model": parsed.model,
                "prompt": encoded.rendered.prompt,
                "special_ranges": [list(span) for span in encoded.rendered.special_ranges],
                "token_ids": encoded.token_ids,
                "count": len(encoded.token_ids),
            }
        )

    return chat_tokenize


def _tokenize(serving: Serving) -> Callable[..., Awaitable[Response]]:
    async def tokenize(request: Request) -> Response:
        """vLLM's ``/tokenize``: a ``prompt`` or ``messages`` → their token ids, as a
        generation would get them."""
        body = _with_model(serving, await serving.read_json(request))
        if ("prompt" in body) == ("messages" in body):
            raise bad_request("/tokenize takes either prompt or messages", "prompt")
        form = TokenizePrompt if "prompt" in body else TokenizeMessages
        _refuse_unnamed(body, form, "/tokenize")
        token_strs = validated(form, body, openai_error).return_token_strs
        protocol = completions.PROTOCOL if "prompt" in body else chat_completions.PROTOCOL
        parsed = protocol.parse(
            {name: value for name, value in body.items() if name != "return_token_strs"}
        )
        encoded = await serving.off_loop(encode_request, parsed, serving.context())
        ids, model = encoded.token_ids, encoded.model
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": model.context_length,
                "tokens": ids,
                "token_strs": [model.tokenizer.tokenizer.id_to_token(i) for i in ids]
                if token_strs
                else None,
            }
        )

    return tokenize


def _detokenize(serving: Serving) -> Callable[..., Awaitable[Response]]:
    async def detokenize(request: Request) -> Response:
        """vLLM's ``/detokenize``: ``tokens`` → the text they decode to, special tokens
        included."""
        body = _with_model(serving, await serving.read_json(request))
        _refuse_unnamed(body, DetokenizeRequest, "/detokenize")
        fields = validated(DetokenizeRequest, body, openai_error)
        tokenizer = resolve_model(fields.model or "", serving.context()).tokenizer.tokenizer
        size = tokenizer.get_vocab_size()
        if any(token >= size for token in fields.tokens):
            raise bad_request(f"tokens must be token ids between 0 and {size - 1}", "tokens")
        text = await serving.off_loop(tokenizer.decode, fields.tokens, False)
        return JSONResponse({"prompt": text})

    return detokenize


def _refuse_unnamed(body: dict[str, Any], form: type[ClosedBody], route: str) -> None:
    """A 400 naming the fields of ``body`` that ``form`` does not name."""
    if extra := [name for name in body if name not in form.model_fields]:
        raise bad_request(f"{route} does not take {', '.join(extra)}", extra[0])


def _with_model(serving: Serving, body: dict[str, Any]) -> dict[str, Any]:
    """``body``, naming the served model when it names none (or null) and only one is served."""
    if body.get("model") is not None:
        return body
    specs = serving.registry.specs()
    if len(specs) != 1:
        raise bad_request("model is required when several models are served", "model")
    return {**body, "model": specs[0].served_name}
