"""OpenAI Responses: ``POST /v1/responses``.

Parsing maps ``instructions`` to a leading system message and the ``input``
items to conversation messages: an assistant ``message`` item and the
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
from api.protocols.openai_common import (
    MAX_TOP_LOGPROBS,
    Fields,
    apply_effort,
    error_body,
    image_detail,
    image_source,
    read_effort,
    read_function,
    read_json_schema,
    read_metadata,
    read_tool_choice,
    responses_usage,
    show,
    token_logprob,
    validated_conversation,
)
from api.protocols.responses_request import ResponsesRequest
from api.protocols.unsupported import refuse
from api.protocols.vllm_extensions import read_structured_outputs
from shared.conversation import (
    RESPONSE_FORMAT_TYPES,
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

ROLES = ("user", "system", "developer", "assistant")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
# Content part types each speaker may send; "tool" is a function_call_output's output.
_PART_TYPES: dict[str, tuple[str, ...]] = {
    "user": ("input_text", "output_text", "input_image", "input_file"),
    "system": ("input_text", "output_text"),
    "developer": ("input_text", "output_text"),
    "assistant": ("output_text", "input_text", "refusal"),
    "tool": ("input_text", "output_text", "input_image", "input_file"),
}
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def parse(body: Any) -> GenerationRequest:
    """A Responses body, validated, as a protocol-free request."""
    fields = Fields(body)
    model = fields.string("model", required=True, non_empty=True) or ""
    stored = _stored_state(fields)
    tools, tool_echo = _tools(fields)
    instructions = fields.string("instructions")
    conversation = Conversation(
        messages=_messages(fields, instructions),
        tools=tools,
        tool_choice=read_tool_choice(fields, tools, nested=False),
        response_format=_text_format(fields),
    )
    reasoning = fields.object("reasoning")
    effort = read_effort(reasoning, "effort") if reasoning else None
    apply_effort(conversation, effort)
    request = GenerationRequest(
        model=model,
        conversation=validated_conversation(conversation, param_from_message=False),
        stream=bool(fields.boolean("stream")),
        max_tokens=fields.integer("max_output_tokens", low=1),
        max_tokens_param="max_output_tokens",
        temperature=fields.number("temperature", 0, 2),
        top_p=fields.number("top_p", 0, 1, low_open=True),
        logprobs=_logprobs(fields),
        thinking_param="reasoning.effort",
        structured_outputs=read_structured_outputs(fields.get("structured_outputs")),
        metadata=read_metadata(fields),
        echo={
            "instructions": instructions,
            "tools": tool_echo,
            "parallel_tool_calls": fields.boolean("parallel_tool_calls") is not False,
            "reasoning": {"effort": effort, "summary": None},
            "user": fields.string("user"),
            "prompt_cache_key": fields.string("prompt_cache_key"),
            "safety_identifier": fields.string("safety_identifier"),
            **stored,
        },
    )
    request.ignored_fields = fields.unread()
    return request


def _stored_state(fields: Fields) -> dict[str, Any]:
    """``store``, ``background`` and ``previous_response_id``, for the response to echo.

    Other fields it cannot honour are refused (``api.protocols.unsupported``).
    """
    fields.read.update(refuse(fields.body, unsupported.RESPONSES))
    store = fields.boolean("store") is not False
    background = bool(fields.boolean("background"))
    if background and not store:
        raise bad_request("background responses must be stored: send store true", "store")
    if fields.has("conversation"):
        raise bad_request(
            "conversation is not supported: conversation objects are not kept on this server; "
            "continue a stored response with previous_response_id",
            "conversation",
        )
    previous = fields.string("previous_response_id", non_empty=True)
    return {"store": store, "background": background, "previous_response_id": previous}


def _messages(fields: Fields, instructions: str | None) -> list[Message]:
    messages: list[Message] = []
    if instructions is not None:
        messages.append(SystemMessage([TextPart(instructions)]))
    value = fields.required("input")
    if isinstance(value, str):
        messages.append(UserMessage([TextPart(value)]))
        return messages
    if not isinstance(value, list) or not value:
        raise fields.error("input", "a string or a non-empty array of input items")
    call_names: dict[str, str] = {}  # call_id -> function name, to name tool results
    for item in fields.objects("input"):
        _add_item(messages, item, call_names)
    return messages


def _add_item(messages: list[Message], item: Fields, call_names: dict[str, str]) -> None:
    kind = item.get("type") or ("message" if item.has("role") else None)
    if kind == "message":
        _add_message(messages, item)
    elif kind == "function_call":
        call = _function_call(item)
        call_names[call.id] = call.name
        _assistant_turn(messages).tool_calls.append(call)
    elif kind == "function_call_output":
        call_id = item.string("call_id", required=True, non_empty=True) or ""
        content = _output_content(item)
        messages.append(ToolMessage(call_id, content, name=call_names.get(call_id)))
    elif kind == "reasoning":
        _add_reasoning(messages, item)
    elif kind == "item_reference":
        raise item.error("type", "an inline item: item_reference needs stored items")
    else:
        raise item.error("type", "one of " + ", ".join(repr(name) for name in ITEM_TYPES))


def _add_message(messages: list[Message], item: Fields) -> None:
    item.required("role")
    role = item.choice("role", ROLES) or ""
    content = _content(item, role)
    if role == "user":
        messages.append(UserMessage(content))
    elif role == "assistant":
        last = messages[-1] if messages else None
        if isinstance(last, AssistantMessage) and not last.content and not last.tool_calls:
            last.content = content  # the answer after this turn's reasoning item
        else:
            messages.append(AssistantMessage(content=content))
    else:
        messages.append(SystemMessage(content, role=role))  # type: ignore[arg-type]


def _assistant_turn(messages: list[Message]) -> AssistantMessage:
    """The assistant turn a function call belongs to: the last message, or a new one."""
    last = messages[-1] if messages else None
    if isinstance(last, AssistantMessage):
        return last
    turn = AssistantMessage()
    messages.append(turn)
    return turn


def _add_reasoning(messages: list[Message], item: Fields) -> None:
    """Reasoning text (or else its summary) opens the next assistant turn; an
    encrypted-only item carries nothing we can read and is skipped."""
    text = _joined_texts(item, "content") or _joined_texts(item, "summary")
    if text:
        messages.append(AssistantMessage(reasoning=text))


def _joined_texts(item: Fields, name: str) -> str:
    return "".join(part.string("text") or "" for part in item.objects(name))


def _function_call(item: Fields) -> ToolCall:
    arguments = item.required("arguments")
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    elif not isinstance(arguments, str):
        raise item.error("arguments", "a JSON string")
    return ToolCall(
        id=item.string("call_id", required=True, non_empty=True) or "",
        name=item.string("name", required=True, non_empty=True) or "",
        arguments=arguments,
    )


def _content(item: Fields, role: str) -> list[ContentPart]:
    value = item.required("content")
    if isinstance(value, str):
        return [TextPart(value)]
    if not isinstance(value, list):
        raise item.error("content", "a string or an array of content parts")
    return [_part(part, role) for part in item.objects("content")]


def _output_content(item: Fields) -> list[ContentPart]:
    value = item.required("output")
    if isinstance(value, str):
        return [TextPart(value)]
    if not isinstance(value, list):
        raise item.error("output", "a string or an array of content parts")
    return [_part(part, "tool") for part in item.objects("output")]


def _part(part: Fields, role: str) -> ContentPart:
    accepted = _PART_TYPES[role]
    kind = part.string("type", required=True)
    if kind not in accepted:
        names = ", ".join(repr(name) for name in accepted)
        speaker = "function_call_output" if role == "tool" else f"{role} message"
        raise bad_request(
            f"{part.where('type')} must be one of {names} in a {speaker}, got {show(kind)}",
            part.where("type"),
        )
    if kind == "input_image":
        return ImagePart(_input_image(part))
    if kind == "input_file":
        return ImagePart(_input_file(part))
    return TextPart(part.string("refusal" if kind == "refusal" else "text", required=True) or "")


def _input_image(part: Fields) -> ImageSource:
    if part.has("file_id") and not part.has("image_url"):
        raise part.error("file_id", "absent: files are not stored here; send image_url instead")
    return image_source(part.required("image_url"), part.where("image_url"), image_detail(part))


def _input_file(part: Fields) -> ImageSource:
    """Only an image sent inline as ``file_data`` (a base64 data URL) can be used."""
    if not part.has("file_data"):
        raise bad_request(
            f"{part.where('file_data')} is required: only images sent inline as a "
            "data:image/...;base64 URL are supported as input_file",
            part.where("file_data"),
        )
    return image_source(part.get("file_data"), part.where("file_data"))


def _tools(fields: Fields) -> tuple[list[Tool], list[dict[str, Any]]]:
    """The function tools, and how the response echoes them."""
    tools, echoes = [], []
    for tool in fields.objects("tools"):
        if tool.get("type") != "function":
            raise tool.error(
                "type", "'function' (built-in tools such as web_search are not supported)"
            )
        function = read_function(tool)
        tools.append(function)
        echoes.append(
            {
                "type": "function",
                "name": function.name,
                "description": function.description,
                "parameters": function.parameters,
                "strict": tool.boolean("strict"),
            }
        )
    return tools, echoes


def _text_format(fields: Fields) -> ResponseFormat:
    text = fields.object("text")
    response_format = text.object("format") if text else None
    if response_format is None:
        return ResponseFormat()
    response_format.required("type")
    kind = response_format.choice("type", RESPONSE_FORMAT_TYPES)
    if kind == "json_schema":
        return read_json_schema(response_format)
    return ResponseFormat(kind)  # type: ignore[arg-type]


def _logprobs(fields: Fields) -> int | None:
    """Logprobs when ``include`` asks for them or ``top_logprobs`` is set."""
    include = fields.array("include") or []
    for value in include:
        if value != LOGPROBS_INCLUDE:
            raise bad_request(
                f"include value {show(value)} is not supported; only {LOGPROBS_INCLUDE!r} is",
                "include",
                "unsupported_parameter",
            )
    top = fields.integer("top_logprobs", 0, MAX_TOP_LOGPROBS)
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
