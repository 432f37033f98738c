"""OpenAI Chat Completions: ``POST /v1/chat/completions``.

Parsing validates the body against ``ChatCompletionRequest`` and maps it to a
protocol-free ``GenerationRequest``; every rejected field gets a 400 that names
its path, its value and what is accepted.
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
from api.protocols.body_validation import openai_error, validated
from api.protocols.chat_completions_request import (
    ChatAssistantMessage,
    ChatCompletionRequest,
    ChatImagePart,
    ChatImageUrl,
    ChatJsonSchemaFormat,
    ChatMessage,
    ChatNamedToolChoice,
    ChatRefusalPart,
    ChatReminderMessage,
    ChatResponseFormat,
    ChatTemplateKwargs,
    ChatTextPart,
    ChatToolCall,
    ChatToolMessage,
    ChatUserMessage,
)
from api.protocols.openai_common import (
    apply_effort,
    chat_usage,
    copies,
    error_body,
    image_source,
    refuse_several_choices,
    show,
    token_logprob,
    tool_choice,
    validated_conversation,
)
from api.protocols.openai_request_parts import FunctionDefinition
from api.protocols.unsupported import refuse
from shared.conversation import (
    AssistantMessage,
    ContentPart,
    Conversation,
    ImagePart,
    Message,
    ReminderMessage,
    ResponseFormat,
    SystemMessage,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    ToolMessage,
    UserMessage,
)

FINISH_REASONS: dict[str, str] = {
    "stop": "stop",
    "stop_sequence": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "abort": "stop",
}


def parse(body: Any) -> GenerationRequest:
    """A Chat Completions body, validated, as a protocol-free request."""
    refused = refuse(body, unsupported.CHAT_COMPLETIONS)
    fields = validated(ChatCompletionRequest, body, openai_error)
    extra = fields.model_extra or {}
    _reject_unsupported(fields, extra)
    tools = [_tool(tool.function) for tool in fields.tools or ()]
    conversation = Conversation(
        messages=_messages(fields),
        tools=tools,
        tool_choice=_tool_choice(fields, tools),
        response_format=_response_format(fields.response_format),
    )
    apply_effort(conversation, fields.reasoning_effort)
    if fields.thinking is not None:
        conversation.thinking = fields.thinking.type == "enabled"
    _apply_template_kwargs(fields.chat_template_kwargs, conversation)
    thinking_param = next(
        (
            name
            for name in ("chat_template_kwargs", "thinking", "reasoning_effort")
            if getattr(fields, name) is not None
        ),
        "thinking",
    )
    max_tokens, max_tokens_param = _max_tokens(fields)
    request = GenerationRequest(
        model=fields.model,
        conversation=validated_conversation(conversation),
        stream=bool(fields.stream),
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        thinking_param=thinking_param,
        logprobs=_logprobs(fields),
        include_usage=fields.include_usage(),
        **fields.sampling(),
        metadata=dict(fields.metadata or {}),
        echo={"user": fields.user, "parallel_tool_calls": fields.parallel_tool_calls is not False},
    )
    request.ignored_fields = [name for name in extra if name not in refused]
    return request


def _reject_unsupported(fields: ChatCompletionRequest, extra: dict[str, Any]) -> None:
    """Fields whose meaning we cannot honour get a 400 rather than being ignored."""
    refuse_several_choices(fields.n)
    if extra.get("functions") is not None:
        raise bad_request(
            "functions is not supported: send the functions as tools "
            '([{"type": "function", "function": {...}}])',
            "functions",
        )


def _messages(fields: ChatCompletionRequest) -> list[Message]:
    if not fields.messages:
        raise bad_request("messages must contain at least one message, got []", "messages")
    messages = [
        _message(message, f"messages[{index}]") for index, message in enumerate(fields.messages)
    ]
    if fields.continue_final_message:
        last = messages[-1]
        if not isinstance(last, AssistantMessage):
            raise bad_request(
                "continue_final_message needs the last message to be an assistant message, "
                f"got role {show(fields.messages[-1].role)}",
                "continue_final_message",
            )
        last.prefix = True
    return messages


def _message(message: ChatMessage, where: str) -> Message:
    content = _content(message.content, f"{where}.content")
    match message:
        case ChatUserMessage():
            return UserMessage(content)
        case ChatAssistantMessage():
            return _assistant(message, content)
        case ChatReminderMessage():
            return ReminderMessage(content)
        case ChatToolMessage():
            return ToolMessage(
                tool_call_id=message.tool_call_id, content=content, name=message.name
            )
    return SystemMessage(content, role=message.role)


def _assistant(message: ChatAssistantMessage, content: list[ContentPart]) -> AssistantMessage:
    """An earlier assistant turn; ``reasoning`` is read too, the name newer vLLM uses."""
    reasoning = message.reasoning_content
    return AssistantMessage(
        content=content,
        reasoning=reasoning if reasoning is not None else message.reasoning,
        tool_calls=[_tool_call(call) for call in message.tool_calls or ()],
        prefix=bool(message.prefix),
    )


def _reasoning_fields(text: str | None) -> dict[str, str | None]:
    """Reasoning under both names clients read: vLLM's ``reasoning``, DeepSeek's
    ``reasoning_content``."""
    return {"reasoning": text, "reasoning_content": text}


def _tool_call(call: ChatToolCall) -> ToolCall:
    """A call's arguments as JSON text: an object some clients send instead is serialised."""
    arguments = call.function.arguments
    if arguments is None:
        arguments = "{}"
    elif isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=call.id, name=call.function.name, arguments=arguments)


def _content(content: str | list[Any] | None, where: str) -> list[ContentPart]:
    if content is None:
        return []
    if isinstance(content, str):
        return [TextPart(content)]
    return [_part(part, f"{where}[{index}]") for index, part in enumerate(content)]


def _part(part: ChatTextPart | ChatImagePart | ChatRefusalPart, where: str) -> ContentPart:
    match part:
        case ChatImagePart(image_url=str() as url):
            return ImagePart(image_source(url, f"{where}.image_url"))
        case ChatImagePart(image_url=ChatImageUrl() as image):
            source = image_source(image.url, f"{where}.image_url.url", image.detail or "auto")
            return ImagePart(source)
        case ChatRefusalPart():
            return TextPart(part.refusal)
    return TextPart(part.text)


def _tool(function: FunctionDefinition) -> Tool:
    """A function's name, description and JSON schema parameters (none: no arguments)."""
    tool = Tool(name=function.name, description=function.description, strict=bool(function.strict))
    if function.parameters is not None:
        tool.parameters = function.parameters
    return tool


def _tool_choice(fields: ChatCompletionRequest, tools: list[Tool]) -> ToolChoice:
    """``tool_choice``: a mode, or a named function that must be among ``tools``;
    ``parallel_tool_calls`` false allows one call per turn."""
    name = None
    if isinstance(fields.tool_choice, ChatNamedToolChoice):
        name = fields.tool_choice.function.name
    mode = "function" if name is not None else fields.tool_choice
    return tool_choice(mode, name, tools, fields.parallel_tool_calls, "tool_choice.function.name")


def _response_format(value: ChatResponseFormat | None) -> ResponseFormat:
    match value:
        case None:
            return ResponseFormat()
        case ChatJsonSchemaFormat(json_schema=spec):
            return spec.response_format("response_format.json_schema.schema")
    return ResponseFormat(value.type)


def _apply_template_kwargs(kwargs: ChatTemplateKwargs | None, conversation: Conversation) -> None:
    """vLLM's ``chat_template_kwargs.enable_thinking`` (or ``thinking``) switches reasoning."""
    if kwargs is None:
        return
    for value in (kwargs.enable_thinking, kwargs.thinking):
        if value is not None:
            conversation.thinking = value
            return


def _max_tokens(fields: ChatCompletionRequest) -> tuple[int | None, str]:
    """``max_completion_tokens`` wins over the older ``max_tokens`` when both are sent."""
    if fields.max_completion_tokens is not None:
        return fields.max_completion_tokens, "max_completion_tokens"
    return fields.max_tokens, "max_tokens"


def _logprobs(fields: ChatCompletionRequest) -> int | None:
    top = fields.top_logprobs
    if top is not None and not fields.logprobs:
        raise bad_request(
            f"top_logprobs needs logprobs: true, got logprobs {show(fields.logprobs)}",
            "top_logprobs",
        )
    return (top or 0) if fields.logprobs else None


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
