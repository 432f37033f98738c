"""OpenAI Responses: ``POST /v1/responses``.

Parsing validates the body against ``ResponsesRequest`` and maps it to a
protocol-free ``GenerationRequest``; every rejected field gets a 400 that names
its path, its value and what is accepted. Unknown fields are ignored, as the
OpenAI API does. ``instructions`` becomes a leading system message and the
``input`` items conversation messages: an assistant ``message`` item and the
``function_call`` items after it form one assistant turn, ``reasoning`` items
give that turn its reasoning, and ``function_call_output`` items become tool
results. ``store`` (true unless false) and ``background`` are echoed; the
route keeps or queues the response (``api.jobs.responses``), and resolves
``previous_response_id`` into ``input`` before parsing, so parsing only
echoes it. ``conversation`` objects are not kept: a 400.

The builder emits the typed events the ``openai`` SDK reads, each with its
``type`` as the SSE event name and a ``sequence_number`` counting from 0. Output
items follow the generated text: a ``reasoning`` item (its text as a
``reasoning_text`` content part), a ``message`` item (one ``output_text`` part),
and one ``function_call`` item per tool call. ``length`` ends the response as
``incomplete`` with reason ``max_output_tokens``; ``abort`` as ``incomplete``
with no reason, because the event stream has no ``cancelled`` ending.
"""

from __future__ import annotations

import copy
import itertools
import json
import time
import uuid
from typing import Any

from api.errors import ApiError, bad_request
from api.output_parser import (
    ContentDelta,
    Delta,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
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
from api.protocols.openai_common import (
    apply_effort,
    error_body,
    image_source,
    responses_usage,
    show,
    token_logprob,
    tool_choice,
    validated_conversation,
)
from api.protocols.responses_request import (
    INPUT_ACCEPTED,
    LOGPROBS_INCLUDE,
    AssistantMessageItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputContent,
    InputFile,
    InputImage,
    InputItem,
    MessageItem,
    ReasoningItem,
    RefusalContent,
    ResponsesFunctionTool,
    ResponsesJsonSchemaFormat,
    ResponsesNamedToolChoice,
    ResponsesRequest,
    UserMessageItem,
)
from api.protocols.unsupported import refuse
from shared.conversation import (
    AssistantMessage,
    ContentPart,
    Conversation,
    ImagePart,
    ImageSource,
    Message,
    ResponseFormat,
    SystemMessage,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    ToolMessage,
    UserMessage,
)


def parse(body: Any) -> GenerationRequest:
    """A Responses body, validated, as a protocol-free request."""
    refused = refuse(body, unsupported.RESPONSES)
    fields = validated(ResponsesRequest, body, openai_error)
    extra = fields.model_extra or {}
    stored = _stored_state(fields, extra)
    tools = [_tool(tool) for tool in fields.tools or ()]
    conversation = Conversation(
        messages=_messages(fields),
        tools=tools,
        tool_choice=_tool_choice(fields, tools),
        response_format=_text_format(fields),
    )
    effort = fields.reasoning.effort if fields.reasoning else None
    apply_effort(conversation, effort)
    outputs = fields.structured_outputs
    request = GenerationRequest(
        model=fields.model,
        conversation=validated_conversation(conversation, param_from_message=False),
        stream=bool(fields.stream),
        max_tokens=fields.max_output_tokens,
        max_tokens_param="max_output_tokens",
        temperature=fields.temperature,
        top_p=fields.top_p,
        logprobs=_logprobs(fields),
        thinking_param="reasoning.effort",
        structured_outputs=None if outputs is None else outputs.constraint(),
        metadata=dict(fields.metadata or {}),
        echo={
            "instructions": fields.instructions,
            "tools": [_tool_echo(tool) for tool in fields.tools or ()],
            "parallel_tool_calls": fields.parallel_tool_calls is not False,
            "reasoning": {"effort": effort, "summary": None},
            "user": fields.user,
            "prompt_cache_key": fields.prompt_cache_key,
            "safety_identifier": fields.safety_identifier,
            **stored,
        },
    )
    request.ignored_fields = [name for name in extra if name not in refused]
    return request


def _stored_state(fields: ResponsesRequest, extra: dict[str, Any]) -> dict[str, Any]:
    """``store``, ``background`` and ``previous_response_id``, for the response to echo.

    A ``conversation`` object is refused: none is kept here.
    """
    store = fields.store is not False
    background = bool(fields.background)
    if background and not store:
        raise bad_request("background responses must be stored: send store true", "store")
    if extra.get("conversation") is not None:
        raise bad_request(
            "conversation is not supported: conversation objects are not kept on this server; "
            "continue a stored response with previous_response_id",
            "conversation",
        )
    return {
        "store": store,
        "background": background,
        "previous_response_id": fields.previous_response_id,
    }


def _messages(fields: ResponsesRequest) -> list[Message]:
    messages: list[Message] = []
    if fields.instructions is not None:
        messages.append(SystemMessage([TextPart(fields.instructions)]))
    if isinstance(fields.input, str):
        messages.append(UserMessage([TextPart(fields.input)]))
        return messages
    if not fields.input:
        raise bad_request(f"input must be {INPUT_ACCEPTED}, got []", "input")
    call_names: dict[str, str] = {}  # call_id -> function name, to name tool results
    for index, item in enumerate(fields.input):
        _add_item(messages, item, f"input[{index}]", call_names)
    return messages


def _add_item(
    messages: list[Message], item: InputItem, where: str, call_names: dict[str, str]
) -> None:
    match item:
        case FunctionCallItem():
            call = _function_call(item)
            call_names[call.id] = call.name
            _assistant_turn(messages).tool_calls.append(call)
        case FunctionCallOutputItem(call_id=call_id):
            content = _content(item.output, f"{where}.output")
            messages.append(ToolMessage(call_id, content, name=call_names.get(call_id)))
        case ReasoningItem():
            _add_reasoning(messages, item)
        case _:
            _add_message(messages, item, f"{where}.content")


def _add_message(messages: list[Message], item: MessageItem, where: str) -> None:
    """``where`` is the path of the item's content."""
    content = _content(item.content, where)
    match item:
        case UserMessageItem():
            messages.append(UserMessage(content))
        case AssistantMessageItem():
            last = messages[-1] if messages else None
            if isinstance(last, AssistantMessage) and not last.content and not last.tool_calls:
                last.content = content  # the answer after this turn's reasoning item
            else:
                messages.append(AssistantMessage(content=content))
        case _:
            messages.append(SystemMessage(content, role=item.role))


def _assistant_turn(messages: list[Message]) -> AssistantMessage:
    """The assistant turn a function call belongs to: the last message, or a new one."""
    last = messages[-1] if messages else None
    if isinstance(last, AssistantMessage):
        return last
    turn = AssistantMessage()
    messages.append(turn)
    return turn


def _add_reasoning(messages: list[Message], item: ReasoningItem) -> None:
    """Reasoning text (or else its summary) opens the next assistant turn; an
    encrypted-only item carries nothing we can read and is skipped."""
    text = "".join(part.text for part in item.content or ()) or "".join(
        part.text for part in item.summary or ()
    )
    if text:
        messages.append(AssistantMessage(reasoning=text))


def _function_call(item: FunctionCallItem) -> ToolCall:
    """A call's arguments as JSON text: an object some clients send instead is serialised."""
    arguments = item.arguments
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=item.call_id, name=item.name, arguments=arguments)


def _content(content: str | list[InputContent], where: str) -> list[ContentPart]:
    if isinstance(content, str):
        return [TextPart(content)]
    return [_part(part, f"{where}[{index}]") for index, part in enumerate(content)]


def _part(part: InputContent, where: str) -> ContentPart:
    match part:
        case InputImage():
            return ImagePart(_input_image(part, where))
        case InputFile():
            return ImagePart(_input_file(part, where))
        case RefusalContent():
            return TextPart(part.refusal)
    return TextPart(part.text)


def _input_image(part: InputImage, where: str) -> ImageSource:
    """An image by URL; one named by ``file_id`` alone cannot be read (no files are kept)."""
    if part.image_url is None:
        if part.file_id is not None:
            raise bad_request(
                f"{where}.file_id must be absent: files are not stored here; send image_url "
                f"instead, got {show(part.file_id)}",
                f"{where}.file_id",
            )
        raise bad_request(f"{where}.image_url is required", f"{where}.image_url")
    return image_source(part.image_url, f"{where}.image_url", part.detail or "auto")


def _input_file(part: InputFile, where: str) -> ImageSource:
    """Only an image sent inline as ``file_data`` (a base64 data URL) can be used."""
    if part.file_data is None:
        raise bad_request(
            f"{where}.file_data is required: only images sent inline as a "
            "data:image/...;base64 URL are supported as input_file",
            f"{where}.file_data",
        )
    return image_source(part.file_data, f"{where}.file_data")


def _tool(tool: ResponsesFunctionTool) -> Tool:
    """A function's name, description and JSON schema parameters (none: no arguments)."""
    function = Tool(name=tool.name, description=tool.description, strict=bool(tool.strict))
    if tool.parameters is not None:
        function.parameters = tool.parameters
    return function


def _tool_echo(tool: ResponsesFunctionTool) -> dict[str, Any]:
    return {
        "type": "function",
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": tool.strict,
    }


def _tool_choice(fields: ResponsesRequest, tools: list[Tool]) -> ToolChoice:
    """``tool_choice``: a mode, or a named function that must be among ``tools``;
    ``parallel_tool_calls`` false allows one call per turn."""
    name = None
    if isinstance(fields.tool_choice, ResponsesNamedToolChoice):
        name = fields.tool_choice.name
    mode = "function" if name is not None else fields.tool_choice
    return tool_choice(mode, name, tools, fields.parallel_tool_calls, "tool_choice.name")


def _text_format(fields: ResponsesRequest) -> ResponseFormat:
    response_format = fields.text.format if fields.text else None
    match response_format:
        case None:
            return ResponseFormat()
        case ResponsesJsonSchemaFormat():
            return response_format.response_format("text.format.schema")
    return ResponseFormat(response_format.type)


def _logprobs(fields: ResponsesRequest) -> int | None:
    """Logprobs when ``include`` asks for them or ``top_logprobs`` is set; ``include``
    serves no other value."""
    include = fields.include or []
    for value in include:
        if value != LOGPROBS_INCLUDE:
            raise bad_request(
                f"include value {show(value)} is not supported; only {LOGPROBS_INCLUDE!r} is",
                "include",
                "unsupported_parameter",
            )
    top = fields.top_logprobs
    if top is None and LOGPROBS_INCLUDE not in include:
        return None
    return top or 0


def _format_echo(response_format: ResponseFormat) -> dict[str, Any]:
    if response_format.type != "json_schema":
        return {"type": response_format.type}
    return {
        "type": "json_schema",
        "name": response_format.name or "response",
        "schema": response_format.schema,
        "strict": response_format.strict,
    }


def _tool_choice_echo(choice: ToolChoice) -> str | dict[str, Any]:
    return {"type": "function", "name": choice.name} if choice.mode == "function" else choice.mode


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesBuilder(ResponseBuilder):
    """Output items and their events for one response.

    ``_output`` holds the items as they grow; the one receiving deltas is
    ``_open`` (always the last). Events carry copies, so a chunk never changes
    after it is returned. Logprobs are kept for answer text only: those given
    with a reasoning or tool call delta have no place in this protocol.
    """

    def __init__(self, request: GenerationRequest, context: ResponseContext) -> None:
        super().__init__(request, context)
        self._sequence = itertools.count()
        self._output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}
        self._status = "in_progress"
        self._incomplete: dict[str, Any] | None = None
        self._error: dict[str, Any] | None = None
        self._usage: Usage | None = None
        self._completed_at: int | None = None

    def start(self, usage: Usage) -> list[SSEChunk]:
        """``created`` then ``in_progress``; usage stays null until the response ends."""
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def delta(self, delta: Delta, logprobs: list[LogprobEntry] | None = None) -> list[SSEChunk]:
        match delta:
            case ContentDelta(text=text):
                return self._text(text, logprobs)
            case ReasoningDelta(text=text):
                return self._reasoning(text)
            case ToolCallStart():
                return self._call_start(delta)
            case ToolCallArgsDelta(index=index, text=text):
                return self._call_arguments(self._calls[index], text)
            case ToolCallEnd():
                return self._close("completed")
        return []

    def finish(self, kind: FinishKind, usage: Usage, stop_sequence: str | None) -> list[SSEChunk]:
        ended = "completed" if kind in ("stop", "stop_sequence", "tool_calls") else "incomplete"
        events = self._close(ended)
        if not self._output:  # the answer is always there, even when empty
            events += self._open_item("message") + self._close(ended)
        self._status, self._usage = ended, usage
        if kind == "length":
            self._incomplete = {"reason": "max_output_tokens"}
        elif ended == "incomplete":
            self._incomplete = {"reason": None}
        else:
            self._completed_at = int(time.time())
        events.append(self._event(f"response.{ended}", response=self.response()))
        return events

    def response(self) -> dict[str, Any]:
        request, echo = self.request, self.request.echo
        return {
            "id": self.context.request_id,
            "object": "response",
            "created_at": self.context.created,
            "status": self._status,
            "completed_at": self._completed_at,
            "background": echo.get("background", False),
            "error": self._error,
            "incomplete_details": self._incomplete,
            "instructions": echo.get("instructions"),
            "max_output_tokens": request.max_tokens,
            "metadata": request.metadata,
            "model": self.context.model,
            "output": copy.deepcopy(self._output),
            "parallel_tool_calls": echo.get("parallel_tool_calls", True),
            "previous_response_id": echo.get("previous_response_id"),
            "prompt_cache_key": echo.get("prompt_cache_key"),
            "reasoning": echo.get("reasoning", {"effort": None, "summary": None}),
            "safety_identifier": echo.get("safety_identifier"),
            "store": echo.get("store", True),
            "temperature": request.temperature,
            "text": {"format": _format_echo(request.conversation.response_format)},
            "tool_choice": _tool_choice_echo(request.conversation.tool_choice),
            "tools": echo.get("tools", []),
            "top_logprobs": request.logprobs,
            "top_p": request.top_p,
            "truncation": "disabled",
            "usage": None if self._usage is None else responses_usage(self._usage),
            "user": echo.get("user"),
        }

    def stream_error(self, error: ApiError) -> list[SSEChunk]:
        """An ``error`` event, then ``response.failed`` so the lifecycle has its end."""
        code = _failure_code(error)
        self._status = "failed"
        self._error = {"code": code, "message": error.message}
        return [
            self._event("error", code=error.code or code, message=error.message, param=error.param),
            self._event("response.failed", response=self.response()),
        ]

    def _text(self, text: str, logprobs: list[LogprobEntry] | None) -> list[SSEChunk]:
        events = self._open_item("message")
        item = self._open
        assert item is not None
        part = item["content"][0]
        wanted = self.request.logprobs is not None
        entries = [token_logprob(entry) for entry in logprobs or []] if wanted else []
        part["text"] += text
        part["logprobs"] += entries
        events.append(self._part_event("response.output_text.delta", delta=text, logprobs=entries))
        return events

    def _reasoning(self, text: str) -> list[SSEChunk]:
        events = self._open_item("reasoning")
        assert self._open is not None
        self._open["content"][0]["text"] += text
        events.append(self._part_event("response.reasoning_text.delta", delta=text))
        return events

    def _call_start(self, start: ToolCallStart) -> list[SSEChunk]:
        events = self._close("completed")
        item = {
            "id": _new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": start.id,
            "name": start.name,
            "arguments": "",
        }
        self._calls[start.index] = item
        return events + self._add(item)

    def _call_arguments(self, item: dict[str, Any], text: str) -> list[SSEChunk]:
        item["arguments"] += text
        return [
            self._event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=self._index_of(item),
                delta=text,
            )
        ]

    def _open_item(self, kind: str) -> list[SSEChunk]:
        """Make the open item a ``message`` or ``reasoning`` one, closing another kind."""
        if self._open is not None and self._open["type"] == kind:
            return []
        events = self._close("completed")
        if kind == "message":
            item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        item["status"] = "in_progress"
        events += self._add(item)
        item["content"].append(part)
        events.append(self._part_event("response.content_part.added", part=copy.deepcopy(part)))
        return events

    def _add(self, item: dict[str, Any]) -> list[SSEChunk]:
        self._output.append(item)
        self._open = item
        return [
            self._event(
                "response.output_item.added",
                output_index=len(self._output) - 1,
                item=copy.deepcopy(item),
            )
        ]

    def _close(self, status: str) -> list[SSEChunk]:
        """The ``done`` events of the open item, which ends with ``status``."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        output_index = self._index_of(item)
        events = []
        if item["type"] == "function_call":
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=output_index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        else:
            events += self._part_done(item, output_index)
        events.append(
            self._event(
                "response.output_item.done", output_index=output_index, item=copy.deepcopy(item)
            )
        )
        return events

    def _part_done(self, item: dict[str, Any], output_index: int) -> list[SSEChunk]:
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": output_index, "content_index": 0}
        if item["type"] == "message":
            text_done = self._event(
                "response.output_text.done",
                **where,
                text=part["text"],
                logprobs=copy.deepcopy(part["logprobs"]),
            )
        else:
            text_done = self._event("response.reasoning_text.done", **where, text=part["text"])
        return [
            text_done,
            self._event("response.content_part.done", **where, part=copy.deepcopy(part)),
        ]

    def _index_of(self, item: dict[str, Any]) -> int:
        return next(index for index, known in enumerate(self._output) if known is item)

    def _part_event(self, kind: str, **fields: Any) -> SSEChunk:
        """An event about content part 0 of the open item."""
        item = self._open
        assert item is not None
        where = {"item_id": item["id"], "output_index": len(self._output) - 1, "content_index": 0}
        return self._event(kind, **where, **fields)

    def _event(self, kind: str, **fields: Any) -> SSEChunk:
        return SSEChunk({"type": kind, "sequence_number": next(self._sequence), **fields}, kind)


def _failure_code(error: ApiError) -> str:
    """``response.error.code`` is a closed list in the SDK; map our statuses onto it."""
    if error.status == 429:
        return "rate_limit_exceeded"
    return "invalid_prompt" if error.status == 400 else "server_error"


PROTOCOL = Protocol(
    name="responses",
    path="/v1/responses",
    id_prefix="resp_",
    parse=parse,
    builder=ResponsesBuilder,
    error_body=error_body,
    request_model=ResponsesRequest,
)
