"""OpenAI (legacy) Completions: ``POST /v1/completions``.

The prompt is a string or a list of token ids (a list holding one of either
is the same prompt), taken as it is: no chat template, and control-token
spellings in the text are plain text unless the model's registry entry opts
out. ``echo`` starts the text with the prompt; with ``logprobs`` too, the
prompt's tokens come with their log-probabilities (the first token has none),
which is what loglikelihood evaluation reads; ``max_tokens: 0`` with ``echo``
scores the prompt and generates nothing. The body is validated against
``CompletionRequest``; its sampling fields and vLLM's extensions are those
Chat Completions takes (``SamplingFields``).

A list of several prompts is one choice per prompt, in order (``split``
makes one body per prompt; the route runs them together and joins their
choices and usage). Refused with a 400: ``n`` or ``best_of`` above 1 and
``suffix``.

``logprobs`` is the legacy object: ``tokens``, ``token_logprobs``,
``top_logprobs`` (a token → logprob map holding the chosen token and the
``logprobs`` likeliest) and ``text_offset`` (each token's offset in ``text``).
"""

from __future__ import annotations

from typing import Any

from api.errors import bad_request
from api.output_parser import ContentDelta, Delta
from api.protocols import unsupported
from api.protocols.base import (
    FinishKind,
    GenerationRequest,
    LogprobEntry,
    Protocol,
    RawPrompt,
    ResponseBuilder,
    ResponseContext,
    SSEChunk,
    Usage,
)
from api.protocols.body_validation import openai_error, validated
from api.protocols.chat_completions import FINISH_REASONS
from api.protocols.completions_request import CompletionRequest
from api.protocols.openai_common import (
    chat_usage,
    copies,
    error_body,
    finite,
    refuse_several_choices,
    show,
)
from api.protocols.unsupported import refuse
from shared.conversation import Conversation

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this route


def parse(body: Any) -> GenerationRequest:
    """A Completions body, validated, as a protocol-free request."""
    refused = refuse(body, unsupported.COMPLETIONS)
    fields = validated(CompletionRequest, body, openai_error)
    _refuse_several(fields)
    echo = bool(fields.echo)
    max_tokens, logprobs = fields.max_tokens, fields.logprobs
    if max_tokens == 0 and not echo:
        raise bad_request("max_tokens must be at least 1 unless echo is true, got 0", "max_tokens")
    request = GenerationRequest(
        model=fields.model,
        conversation=Conversation(messages=[], thinking=False),
        prompt=RawPrompt(**_prompt(fields.prompt), echo=echo),
        stream=bool(fields.stream),
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        logprobs=logprobs,
        # the prompt is scored when its logprobs are shown, or when it is all there is to do
        prompt_logprobs=logprobs if echo and logprobs is not None else _if_zero(max_tokens),
        include_usage=fields.include_usage(),
        echo={"user": fields.user},
        **fields.sampling(),
    )
    request.ignored_fields = [name for name in fields.model_extra or () if name not in refused]
    return request


def _if_zero(max_tokens: int | None) -> int | None:
    return 0 if max_tokens == 0 else None


def _refuse_several(fields: CompletionRequest) -> None:
    """``n`` and ``best_of`` above 1, and a ``suffix``, ask for what is not served here."""
    refuse_several_choices(fields.n)
    if fields.best_of is not None and fields.best_of > 1:
        raise bad_request(
            f"best_of > 1 is not supported, got {fields.best_of}",
            "best_of",
            "unsupported_parameter",
        )
    if fields.suffix:
        raise bad_request(
            "suffix is not supported by this server", "suffix", "unsupported_parameter"
        )


MAX_PROMPTS = 64


def choice_bodies(body: dict[str, Any]) -> list[dict[str, Any]]:
    """One body per choice: per prompt of a ``prompt`` that lists several, ``n`` each."""
    return [each for prompt in split(body) for each in copies(prompt)]


def split(body: dict[str, Any]) -> list[dict[str, Any]]:
    """One body per prompt of a body whose ``prompt`` lists several, else ``[body]``."""
    prompts = body.get("prompt")
    if not _several(prompts):
        return [body]
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(
            f"prompt may list at most {MAX_PROMPTS} prompts, got {len(prompts)}",
            "prompt",
            "limit_exceeded",
        )
    return [{**body, "prompt": prompt} for prompt in prompts]


def _several(value: Any) -> bool:
    return (
        isinstance(value, list) and len(value) > 1 and all(isinstance(v, str | list) for v in value)
    )


def _prompt(prompt: str | list[int] | list[str | list[int]]) -> dict[str, Any]:
    """``text`` or ``token_ids`` of the one prompt the body holds."""
    value = prompt
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one prompt
    elif _several(value):  # only the synchronous route splits a body (``split``)
        raise bad_request(
            f"prompt: {len(value)} prompts in one body are only accepted by POST "
            "/v1/completions itself; send one prompt per job",
            "prompt",
            "unsupported_parameter",
        )
    if isinstance(value, str):
        return {"text": value}
    if value and all(isinstance(token, int) for token in value):
        return {"token_ids": list(value)}
    accepted = "a string, an array of token ids, or an array holding one of either"
    raise bad_request(f"prompt must be {accepted}, got {show(prompt)}", "prompt")


class CompletionBuilder(ResponseBuilder):
    """``text_completion`` chunks and body for one choice."""

    def __init__(self, request: GenerationRequest, context: ResponseContext) -> None:
        super().__init__(request, context)
        assert request.prompt is not None
        self._prompt = request.prompt
        self._text: list[str] = []
        self._logprobs = LegacyLogprobs()
        self._finish_reason = "stop"
        self._stop_reason: str | None = None
        self._usage = Usage()
        self._prompt_entries: list[LogprobEntry | tuple[str, list[int]]] = []

    def prompt_logprobs(self, first: tuple[str, list[int]], entries: list[LogprobEntry]) -> None:
        if self._prompt.echo and self.request.logprobs is not None:
            self._prompt_entries = [first, *entries]

    def start(self, usage: Usage) -> list[SSEChunk]:
        self._usage = usage
        if not self._prompt.echo:
            return []
        text = self._prompt.text or ""
        self._text.append(text)
        return [self._chunk(text, self._logprobs.add(self._prompt_entries))]

    def delta(self, delta: Delta, logprobs: list[LogprobEntry] | None = None) -> list[SSEChunk]:
        match delta:
            case ContentDelta(text=text):
                self._text.append(text)
                return [self._chunk(text, self._logprobs.add(list(logprobs or [])))]
        return []  # no reasoning or tool calls: the raw prompt asks for neither

    def finish(self, kind: FinishKind, usage: Usage, stop_sequence: str | None) -> list[SSEChunk]:
        self._usage = usage
        self._finish_reason = FINISH_REASONS[kind]
        self._stop_reason = stop_sequence
        chunks = [self._chunk("", None, self._finish_reason)]
        if self.request.include_usage:
            chunks.append(SSEChunk({**self._head(), "choices": [], "usage": chat_usage(usage)}))
        return chunks

    def response(self) -> dict[str, Any]:
        choice = {
            "index": self.context.choice,
            "text": "".join(self._text),
            "logprobs": self._logprobs.whole() if self.request.logprobs is not None else None,
            "finish_reason": self._finish_reason,
            "stop_reason": self._stop_reason,
        }
        return {**self._head(), "choices": [choice], "usage": chat_usage(self._usage)}

    def stream_error(self, error: Any) -> list[SSEChunk]:
        return [SSEChunk(error_body(error))]

    def _chunk(
        self, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None = None
    ) -> SSEChunk:
        choice: dict[str, Any] = {
            "index": self.context.choice,
            "text": text,
            "logprobs": logprobs if self.request.logprobs is not None else None,
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = self._stop_reason
        chunk = {**self._head(), "choices": [choice]}
        if self.request.include_usage:
            chunk["usage"] = None
        return SSEChunk(chunk)

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.context.request_id,
            "object": "text_completion",
            "created": self.context.created,
            "model": self.context.model,
            "system_fingerprint": self.context.system_fingerprint,
        }


class LegacyLogprobs:
    """The legacy ``logprobs`` object, built a piece at a time; offsets run across pieces."""

    def __init__(self) -> None:
        self._whole: dict[str, list[Any]] = _empty()
        self._offset = 0

    def add(self, entries: list[LogprobEntry | tuple[str, list[int]]]) -> dict[str, list[Any]]:
        """The object for ``entries`` (a bare ``(token, bytes)`` has no logprob), also kept."""
        piece = _empty()
        for entry in entries:
            if isinstance(entry, LogprobEntry):
                token, logprob = entry.token, finite(entry.logprob)
                alternatives = {token: logprob} | {
                    alt: finite(value) for alt, _, value in entry.top
                }
            else:
                token, logprob, alternatives = entry[0], None, None
            piece["tokens"].append(token)
            piece["token_logprobs"].append(logprob)
            piece["top_logprobs"].append(alternatives)
            piece["text_offset"].append(self._offset)
            self._offset += len(token)
        for name, values in piece.items():
            self._whole[name] += values
        return piece

    def whole(self) -> dict[str, list[Any]]:
        return self._whole


def _empty() -> dict[str, list[Any]]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


PROTOCOL = Protocol(
    name="completions",
    path="/v1/completions",
    id_prefix="cmpl-",
    parse=parse,
    builder=CompletionBuilder,
    error_body=error_body,
    request_model=CompletionRequest,
    done_marker="[DONE]",
    choice_bodies=choice_bodies,
    chunk_object="text_completion",
)
