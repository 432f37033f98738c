"""What every protocol provides, and the protocol-free values they exchange.

A protocol is one row: a parser from the request body to a
``GenerationRequest`` (conversation + options, no protocol names left), a
``ResponseBuilder`` factory that turns the engine's output (already parsed into
``api.output_parser`` deltas) into the protocol's stream chunks and final JSON,
and a renderer for errors. The route handlers, preparation and streaming code
never look at a protocol's field names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from api.errors import ApiError
from api.output_parser import Delta
from shared.conversation import Conversation
from shared.sampling import StructuredOutputs

# Why a generation ended, in protocol-free words. Each protocol maps them:
# chat: stop/stop/length/tool_calls; messages: end_turn/stop_sequence/max_tokens/tool_use.
FinishKind = Literal["stop", "stop_sequence", "length", "tool_calls", "abort"]


@dataclass(slots=True)
class RawPrompt:
    """A prompt taken as it is, with no chat template (``/v1/completions``).

    Exactly one of ``text`` and ``token_ids``; preparation fills ``text`` for
    token ids (the response may echo it). ``echo`` starts the response with it.
    """

    text: str | None = None
    token_ids: list[int] | None = None
    echo: bool = False


@dataclass(slots=True)
class GenerationRequest:
    """A request body, understood: the conversation and how to generate.

    ``None`` means "the protocol did not say"; preparation fills defaults.
    ``max_tokens`` is resolved against the context after encoding. With a
    ``prompt``, the conversation is empty and the prompt is encoded as it is.
    """

    model: str
    conversation: Conversation
    prompt: RawPrompt | None = None
    stream: bool = False
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # the field name to cite in errors
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    priority: int | None = None  # lower runs first; bounded below by the API key's
    thinking_param: str = "thinking"  # the field that asked for reasoning, to cite in errors
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension field
    logprobs: int | None = None  # number of top alternatives; None = no logprobs
    prompt_logprobs: int | None = None  # the same for prompt tokens (computed in prefill)
    include_usage: bool = False  # Chat Completions stream_options.include_usage
    metadata: dict[str, Any] = field(default_factory=dict)  # echoed where the protocol does
    echo: dict[str, Any] = field(default_factory=dict)  # protocol-specific fields to echo back
    ignored_fields: list[str] = field(default_factory=list)  # unknown fields, reported, not used


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class LogprobEntry:
    """One generated token with its log-probability and top alternatives (decoded)."""

    token: str
    token_bytes: list[int]
    logprob: float
    top: list[tuple[str, list[int], float]] = field(default_factory=list)


@dataclass(slots=True)
class ResponseContext:
    """Identity of one response, fixed before the first chunk."""

    request_id: str  # the protocol-facing id (chatcmpl-…, resp_…, msg_…)
    model: str  # the model name as the client gave it
    created: int  # unix seconds
    system_fingerprint: str
    choice: int = 0  # which choice of the response this generation is (several prompts)


@dataclass(slots=True)
class SSEChunk:
    """One server-sent event: ``event`` is None for data-only streams (Chat Completions)."""

    data: dict[str, Any] | str
    event: str | None = None


class ResponseBuilder(ABC):
    """Builds one response from protocol-free pieces; stream and non-stream share it.

    Call order: ``start`` once, ``delta`` for each parsed delta (with the
    logprobs of the tokens that produced it, when requested), ``finish`` once.
    Every method returns the stream chunks it produces; ``response()`` returns
    the non-stream JSON body and is valid after ``finish``. Because both come
    from the same calls, stream and non-stream carry the same content, finish
    reason and usage.
    """

    def __init__(self, request: GenerationRequest, context: ResponseContext):
        self.request = request
        self.context = context

    def prompt_logprobs(self, first: tuple[str, list[int]], entries: list[LogprobEntry]) -> None:
        """The prompt's tokens, before ``start``, when the request asked for their logprobs.

        ``first`` is the first token (its text and bytes: it has no logprob),
        ``entries`` the rest. Only a protocol that echoes the prompt shows them.
        """
        return

    @abstractmethod
    def start(self, usage: Usage) -> list[SSEChunk]: ...

    @abstractmethod
    def delta(self, delta: Delta, logprobs: list[LogprobEntry] | None = None) -> list[SSEChunk]: ...

    @abstractmethod
    def finish(
        self, kind: FinishKind, usage: Usage, stop_sequence: str | None
    ) -> list[SSEChunk]: ...

    @abstractmethod
    def response(self) -> dict[str, Any]: ...

    def stream_error(self, error: ApiError) -> list[SSEChunk]:
        """Chunks that report an error after the stream has started."""
        return [SSEChunk({"error": {"message": error.message, "type": error.type}}, "error")]


@dataclass(frozen=True, slots=True)
class Protocol:
    """One row of the protocol table."""

    name: str  # "chat.completions" | "responses" | "messages"
    path: str  # the route, e.g. "/v1/chat/completions"
    id_prefix: str  # "chatcmpl-" | "resp_" | "msg_"
    parse: Callable[[dict[str, Any]], GenerationRequest]  # raises ApiError (400) naming the field
    builder: Callable[[GenerationRequest, ResponseContext], ResponseBuilder]
    error_body: Callable[[ApiError], dict[str, Any]]
    # The body as the API reference defines it, for /openapi.json; ``parse`` validates a body
    # against it.
    request_model: type[BaseModel]
    done_marker: str | None = None  # Chat Completions ends its stream with "[DONE]"
    # For a protocol whose response holds several choices (``n``, several prompts): a body's
    # one body per choice (``api.choices``), and the ``object`` of its streamed chunks.
    choice_bodies: Callable[[dict[str, Any]], list[dict[str, Any]]] | None = None
    chunk_object: str = ""
    anthropic_rate_limit_headers: bool = False  # anthropic-ratelimit-* instead of x-ratelimit-*
