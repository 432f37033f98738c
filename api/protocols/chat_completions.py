"""OpenAI Chat Completions: ``POST /v1/chat/completions``.

Parsing turns the body into a protocol-free ``GenerationRequest``; every
rejected field gets a 400 that names its path, its value and what is accepted.
Unknown fields are ignored, as the OpenAI API does. Extensions accepted
besides the official fields: vLLM's ``top_k``, ``min_p``,
``repetition_penalty``, ``continue_final_message`` and
``chat_template_kwargs.enable_thinking``; DeepSeek's ``reasoning_content``
(or vLLM's ``reasoning``) and ``prefix`` on assistant messages.

The builder writes the chunks the ``openai`` SDK reads: a role chunk, one
chunk per delta (reasoning travels as ``reasoning``, the name current vLLM
sends, and as ``reasoning_content``, the name DeepSeek and older clients read),
a finish chunk, and the usage chunk when ``stream_options.include_usage``
asks for it. The server appends the ``[DONE]`` marker.

Finish reasons: ``stop`` and ``stop_sequence`` are ``stop`` (the matched
string is in ``stop_reason``, as vLLM reports it), ``length`` is ``length``,
``tool_calls`` is ``tool_calls``, and so is a plain stop after the model called
a tool. ``abort`` is ``stop``: the SDK's types know no other word, and an
aborted stream normally has no reader left.
"""

from __future__ import annotations

import json
from typing import Any

from api.errors import ApiError, bad_request
from api.output_parser import (
    ContentDelta,
    Delta,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallStart,
)
from api.protocols import unsupported
from api.protocols.base import (
    FinishKind,
    GenerationRequest,
    LogprobEntry,
    Protocol,
    ResponseBuilder,
    ResponseContext,
    SSEChunk,
    Usage,
)
from api.protocols.chat_completions_request import ChatCompletionRequest
from api.protocols.openai_common import (
    MAX_TOP_LOGPROBS,
    Fields,
    apply_effort,
    chat_usage,
    copies,
    error_body,
    image_detail,
    image_source,
    read_effort,
    read_function,
    read_json_schema,
    read_metadata,
    read_stop,
    read_tool_choice,
    refuse_several_choices,
    show,
    token_logprob,
    validated,
)
from api.protocols.unsupported import refuse
from api.protocols.vllm_extensions import (
    read_logit_bias,
    read_structured_outputs,
    read_token_ids,
)
from shared.conversation import (
    RESPONSE_FORMAT_TYPES,
    AssistantMessage,
    ContentPart,
    Conversation,
    ImagePart,
    ImageSource,
    Message,
    ReminderMessage,
    ResponseFormat,
    SystemMessage,
    TextPart,
    Tool,
    ToolCall,
    ToolMessage,
    UserMessage,
)

ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
# Content part types each role may send; a refusal an assistant gave is kept as its text.
_PART_TYPES: dict[str, tuple[str, ...]] = {
    "system": ("text",),
    "developer": ("text",),
    "user": ("text", "image_url"),
    "assistant": ("text", "refusal"),
    "tool": ("text",),
    "latest_reminder": ("text",),
}
FINISH_REASONS: dict[str, str] = {
    "stop": "stop",
    "stop_sequence": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "abort": "stop",
}


def parse(body: Any) -> GenerationRequest:
    """A Chat Completions body, validated, as a protocol-free request."""
    fields = Fields(body)
    model = fields.string("model", required=True, non_empty=True) or ""
    _reject_unsupported(fields)
    tools = _tools(fields)
    conversation = Conversation(
        messages=_messages(fields),
        tools=tools,
        tool_choice=read_tool_choice(fields, tools, nested=True),
        response_format=_response_format(fields),
    )
    apply_effort(conversation, read_effort(fields, "reasoning_effort"))
    _apply_thinking(fields, conversation)
    _apply_template_kwargs(fields, conversation)
    thinking_param = next(
        (
            name
            for name in ("chat_template_kwargs", "thinking", "reasoning_effort")
            if fields.has(name)
        ),
        "thinking",
    )
    max_tokens, max_tokens_param = _max_tokens(fields)
    stream = bool(fields.boolean("stream"))
    usage = include_usage(fields)  # read either way, so a malformed value is a 400
    request = GenerationRequest(
        model=model,
        conversation=validated(conversation),
        stream=stream,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        thinking_param=thinking_param,
        logprobs=_logprobs(fields),
        include_usage=stream and usage,
        **read_sampling(fields),
        metadata=read_metadata(fields),
        echo={
            "user": fields.string("user"),
            "parallel_tool_calls": fields.boolean("parallel_tool_calls") is not False,
        },
    )
    request.ignored_fields = fields.unread()
    return request


def read_sampling(fields: Fields) -> dict[str, Any]:
    """The sampling fields Chat Completions and Completions share, with vLLM's extensions."""
    return {
        "temperature": fields.number("temperature", 0, 2),
        "top_p": fields.number("top_p", 0, 1, low_open=True),
        "top_k": _top_k(fields),
        "min_p": fields.number("min_p", 0, 1),
        "seed": fields.integer("seed"),
        "presence_penalty": fields.number("presence_penalty", -2, 2) or 0.0,
        "frequency_penalty": fields.number("frequency_penalty", -2, 2) or 0.0,
        "repetition_penalty": fields.number("repetition_penalty", 0, low_open=True),
        "stop": read_stop(fields),
        "skip_special_tokens": fields.boolean("skip_special_tokens") is not False,
        "priority": fields.integer("priority"),
        "stop_token_ids": read_token_ids(fields, "stop_token_ids"),
        "min_tokens": fields.integer("min_tokens", low=0) or 0,
        "ignore_eos": bool(fields.boolean("ignore_eos")),
        "logit_bias": read_logit_bias(fields),
        "structured_outputs": read_structured_outputs(fields.get("structured_outputs")),
    }


def _reject_unsupported(fields: Fields) -> None:
    """Fields whose meaning we cannot honour get a 400 rather than being ignored."""
    fields.read.update(refuse(fields.body, unsupported.CHAT_COMPLETIONS))
    refuse_several_choices(fields)
    if fields.has("functions"):
        raise bad_request(
            "functions is not supported: send the functions as tools "
            '([{"type": "function", "function": {...}}])',
            "functions",
        )


def _messages(fields: Fields) -> list[Message]:
    if not fields.array("messages", required=True):
        raise bad_request("messages must contain at least one message, got []", "messages")
    messages = [_message(item) for item in fields.objects("messages")]
    if fields.boolean("continue_final_message"):
        last = messages[-1]
        if not isinstance(last, AssistantMessage):
            raise bad_request(
                "continue_final_message needs the last message to be an assistant message, "
                f"got role {show(fields.get('messages')[-1].get('role'))}",
                "continue_final_message",
            )
        last.prefix = True
    return messages


def _message(item: Fields) -> Message:
    item.required("role")
    role = item.choice("role", ROLES)
    if role == "user":
        return UserMessage(_content(item, role, required=True))
    if role == "assistant":
        return _assistant(item)
    if role == "latest_reminder":
        return ReminderMessage(_content(item, role, required=True))
    if role == "tool":
        return ToolMessage(
            tool_call_id=item.string("tool_call_id", required=True, non_empty=True) or "",
            content=_content(item, role, required=True),
            name=item.string("name"),
        )
    return SystemMessage(_content(item, role, required=True), role=role)  # type: ignore[arg-type]


def _assistant(item: Fields) -> AssistantMessage:
    """An earlier assistant turn; ``reasoning`` is read too, the name newer vLLM uses."""
    reasoning = item.string("reasoning_content")
    return AssistantMessage(
        content=_content(item, "assistant", required=False),
        reasoning=reasoning if reasoning is not None else item.string("reasoning"),
        tool_calls=[_tool_call(call) for call in item.objects("tool_calls")],
        prefix=bool(item.boolean("prefix")),
    )


def _reasoning_fields(text: str | None) -> dict[str, str | None]:
    """Reasoning under both names clients read: vLLM's ``reasoning``, DeepSeek's
    ``reasoning_content``."""
    return {"reasoning": text, "reasoning_content": text}


def _tool_call(call: Fields) -> ToolCall:
    call.choice("type", ("function",))
    function = Fields(call.required("function"), call.where("function"))
    return ToolCall(
        id=call.string("id", required=True, non_empty=True) or "",
        name=function.string("name", required=True, non_empty=True) or "",
        arguments=_arguments(function),
    )


def _arguments(function: Fields) -> str:
    """The JSON text of the arguments; an object some clients send instead is serialised."""
    value = function.get("arguments")
    if value is None:
        return "{}"
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str):
        raise function.error("arguments", "a JSON string")
    return value


def _content(item: Fields, role: str, *, required: bool) -> list[ContentPart]:
    value = item.required("content") if required else item.get("content")
    if value is None:
        return []
    if isinstance(value, str):
        return [TextPart(value)]
    if not isinstance(value, list):
        raise item.error("content", "a string or an array of content parts")
    return [_part(part, role) for part in item.objects("content")]


def _part(part: Fields, role: str) -> ContentPart:
    accepted = _PART_TYPES[role]
    kind = part.string("type", required=True)
    if kind not in accepted:
        names = ", ".join(repr(name) for name in accepted)
        raise bad_request(
            f"{part.where('type')} must be one of {names} in a {role} message, got {show(kind)}",
            part.where("type"),
        )
    if kind == "image_url":
        return ImagePart(_image(part))
    return TextPart(part.string(kind if kind == "refusal" else "text", required=True) or "")


def _image(part: Fields) -> ImageSource:
    """``image_url`` is ``{"url": ...}``; a bare URL string is accepted too."""
    value = part.required("image_url")
    if isinstance(value, str):
        return image_source(value, part.where("image_url"))
    image = Fields(value, part.where("image_url"))
    return image_source(image.required("url"), image.where("url"), image_detail(image))


def _tools(fields: Fields) -> list[Tool]:
    tools = []
    for tool in fields.objects("tools"):
        if tool.get("type") != "function":
            raise tool.error("type", "'function' (custom tools are not supported)")
        tools.append(read_function(Fields(tool.required("function"), tool.where("function"))))
    return tools


def _response_format(fields: Fields) -> ResponseFormat:
    response_format = fields.object("response_format")
    if response_format is None:
        return ResponseFormat()
    response_format.required("type")
    kind = response_format.choice("type", RESPONSE_FORMAT_TYPES)
    if kind != "json_schema":
        return ResponseFormat(kind)  # type: ignore[arg-type]
    spec = response_format.required("json_schema")
    return read_json_schema(Fields(spec, response_format.where("json_schema")))


def _apply_thinking(fields: Fields, conversation: Conversation) -> None:
    """A top-level ``thinking: {"type": "enabled" | "disabled"}`` switches reasoning."""
    thinking = fields.object("thinking")
    if thinking is not None:
        thinking.required("type")
        conversation.thinking = thinking.choice("type", ("enabled", "disabled")) == "enabled"


def _apply_template_kwargs(fields: Fields, conversation: Conversation) -> None:
    """vLLM's ``chat_template_kwargs.enable_thinking`` (or ``thinking``) switches reasoning."""
    kwargs = fields.object("chat_template_kwargs")
    if kwargs is None:
        return
    for name in ("enable_thinking", "thinking"):
        value = kwargs.boolean(name)
        if value is not None:
            conversation.thinking = value
            return


def _max_tokens(fields: Fields) -> tuple[int | None, str]:
    """``max_completion_tokens`` wins over the older ``max_tokens`` when both are sent."""
    newer = fields.integer("max_completion_tokens", low=1)
    older = fields.integer("max_tokens", low=1)
    if newer is not None:
        return newer, "max_completion_tokens"
    return older, "max_tokens"


def _top_k(fields: Fields) -> int | None:
    """vLLM spells "no top-k" -1; the sampler spells it 0."""
    top_k = fields.integer("top_k", low=-1)
    return 0 if top_k == -1 else top_k


def _logprobs(fields: Fields) -> int | None:
    wanted = fields.boolean("logprobs")
    top = fields.integer("top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise bad_request(
            f"top_logprobs needs logprobs: true, got logprobs {show(fields.get('logprobs'))}",
            "top_logprobs",
        )
    return (top or 0) if wanted else None


def include_usage(fields: Fields) -> bool:
    options = fields.object("stream_options")
    return bool(options and options.boolean("include_usage"))


class ChatCompletionBuilder(ResponseBuilder):
    """``chat.completion.chunk`` stream and ``chat.completion`` body for one choice.

    Logprobs are reported for answer text only (``logprobs.content``, as
    OpenAI defines it): those given with a reasoning or tool call delta are
    dropped.
    """

    def __init__(self, request: GenerationRequest, context: ResponseContext) -> None:
        super().__init__(request, context)
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._logprobs: list[dict[str, Any]] = []
        self._finish_reason = "stop"
        self._stop_reason: str | None = None
        self._usage = Usage()

    def start(self, usage: Usage) -> list[SSEChunk]:
        self._usage = usage
        return [self._chunk({"role": "assistant", "content": ""})]

    def delta(self, delta: Delta, logprobs: list[LogprobEntry] | None = None) -> list[SSEChunk]:
        match delta:
            case ContentDelta(text=text):
                self._content.append(text)
                return [self._chunk({"content": text}, self._take_logprobs(logprobs))]
            case ReasoningDelta(text=text):
                self._reasoning.append(text)
                return [self._chunk(_reasoning_fields(text))]
            case ToolCallStart(index=index, id=call_id, name=name):
                function = {"name": name, "arguments": ""}
                self._calls[index] = {"id": call_id, "type": "function", "function": function}
                opened = {
                    "index": index,
                    "id": call_id,
                    "type": "function",
                    "function": {**function},
                }
                return [self._chunk({"tool_calls": [opened]})]
            case ToolCallArgsDelta(index=index, text=text):
                self._calls[index]["function"]["arguments"] += text
                piece = {"index": index, "function": {"arguments": text}}
                return [self._chunk({"tool_calls": [piece]})]
        return []

    def finish(self, kind: FinishKind, usage: Usage, stop_sequence: str | None) -> list[SSEChunk]:
        self._usage = usage
        self._finish_reason = FINISH_REASONS[kind]
        if self._calls and kind == "stop":
            self._finish_reason = "tool_calls"
        self._stop_reason = stop_sequence
        chunks = [self._chunk({}, finish_reason=self._finish_reason)]
        if self.request.include_usage:
            chunks.append(SSEChunk({**self._head(), "choices": [], "usage": chat_usage(usage)}))
        return chunks

    def response(self) -> dict[str, Any]:
        content = "".join(self._content)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if not content and self._calls else content,
            **_reasoning_fields("".join(self._reasoning) or None),
        }
        if self._calls:
            message["tool_calls"] = [self._calls[index] for index in sorted(self._calls)]
        choice = {
            "index": self.context.choice,
            "message": message,
            "logprobs": self._choice_logprobs(self._logprobs),
            "finish_reason": self._finish_reason,
            "stop_reason": self._stop_reason,
        }
        body = {
            **self._head("chat.completion"),
            "choices": [choice],
            "usage": chat_usage(self._usage),
        }
        if self.request.metadata:
            body["metadata"] = self.request.metadata
        return body

    def stream_error(self, error: ApiError) -> list[SSEChunk]:
        """A data-only ``{"error": ...}`` chunk: the SDK raises it as an ``APIError``."""
        return [SSEChunk(error_body(error))]

    def _take_logprobs(self, logprobs: list[LogprobEntry] | None) -> list[dict[str, Any]]:
        entries = [token_logprob(entry) for entry in logprobs or []]
        self._logprobs += entries
        return entries

    def _choice_logprobs(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        return None if self.request.logprobs is None else {"content": entries}

    def _chunk(
        self,
        delta: dict[str, Any],
        logprobs: list[dict[str, Any]] | None = None,
        finish_reason: str | None = None,
    ) -> SSEChunk:
        choice: dict[str, Any] = {
            "index": self.context.choice,
            "delta": delta,
            "logprobs": None if logprobs is None else self._choice_logprobs(logprobs),
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = self._stop_reason
        chunk = {**self._head(), "choices": [choice]}
        if self.request.include_usage:
            chunk["usage"] = None  # OpenAI sends null usage on every chunk but the last
        return SSEChunk(chunk)

    def _head(self, kind: str = "chat.completion.chunk") -> dict[str, Any]:
        return {
            "id": self.context.request_id,
            "object": kind,
            "created": self.context.created,
            "model": self.context.model,
            "system_fingerprint": self.context.system_fingerprint,
        }


PROTOCOL = Protocol(
    name="chat.completions",
    path="/v1/chat/completions",
    id_prefix="chatcmpl-",
    parse=parse,
    builder=ChatCompletionBuilder,
    error_body=error_body,
    request_model=ChatCompletionRequest,
    done_marker="[DONE]",
    choice_bodies=copies,
    chunk_object="chat.completion.chunk",
)
