"""Any model's own chat template, rendered safely and with exact control spans.

The template runs in Jinja's immutable sandbox, configured like transformers'
``apply_chat_template`` (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``,
``raise_exception``, a ``tojson`` that keeps non-ASCII text) so a template
renders here exactly as it does there.

Which characters are control tokens is decided by provenance, not by
searching the output: the code generator wraps every string constant of the
template in ``TemplateText`` (see ``template_text``), the ``bos_token`` and
``eos_token`` variables are passed as template text too, and after rendering
only template-written runs are searched for special-token spellings. Message
content, names, arguments, tools and system prompts enter as plain strings and
can never produce a control span.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.conversation import (
    AssistantMessage,
    ContentPart,
    Conversation,
    ConversationError,
    ImagePart,
    Message,
    SystemMessage,
    TextPart,
    ToolMessage,
    UserMessage,
    has_images,
    text_of,
)
from shared.prompting.base import (
    ContentFormat,
    PromptFormatError,
    RenderedPrompt,
    RenderOptions,
)
from shared.prompting.builder import special_pattern
from shared.prompting.template_text import TemplateText, join_text, mark_literal, spans_of
from shared.prompting.tool_json import parsed_arguments, tool_signature
from shared.versions import require

require("jinja2")  # the code generator below is jinja2 3.1's, private hooks included


class TemplateRaised(jinja2.TemplateError):
    """The template called ``raise_exception``: it refuses this conversation."""


class JinjaFormat:
    """Renders ``options.chat_template``, the model's own Jinja chat template."""

    name = "jinja"

    def render(self, conversation: Conversation, options: RenderOptions) -> RenderedPrompt:
        if not options.chat_template:
            raise PromptFormatError(
                "prompt format 'jinja' needs the model's chat template, and this model has none; "
                "choose one of the built-in formats (chatml, qwen3, llama3) instead"
            )
        template = compile_template(options.chat_template)
        cut_marker = _continuation_marker() if conversation.continues_last_message else None
        parts = resolved_content_format(options) == "openai"
        variables = template_variables(conversation, options, cut_marker, parts=parts)
        text = _render(template, variables)
        if cut_marker is not None:
            text = _cut_at(text, cut_marker)
        return RenderedPrompt(
            prompt=str.__str__(text),
            special_ranges=template_special_ranges(text, options.special_tokens),
            image_sources=[
                part.source
                for message in conversation.messages
                for part in getattr(message, "content", [])
                if isinstance(part, ImagePart)
            ],
        )


def template_special_ranges(text: str, special_tokens: Iterable[str]) -> list[tuple[int, int]]:
    """Special-token spellings found inside template-written runs only.

    Each run is searched on its own, so a spelling that straddles template
    text and user text is not a control token.
    """
    pattern = special_pattern(special_tokens)
    return [
        match.span()
        for start, end in spans_of(text)
        for match in pattern.finditer(text, start, end)
    ]


def template_variables(
    conversation: Conversation,
    options: RenderOptions,
    cut_marker: str | None = None,
    *,
    parts: bool = False,
) -> dict[str, Any]:
    """What transformers passes to a chat template, built from a Conversation.

    Keys a template tests for presence (``tool_calls``, ``reasoning_content``,
    ``enable_thinking``) are only set when they carry something, because
    templates such as Llama 3.1's branch on ``'tool_calls' in message``.
    With ``parts`` every message's content is a list of typed parts, as
    templates that iterate over content expect; otherwise text-only content
    is one string.
    """
    last = len(conversation.messages) - 1
    messages = [
        _message_dict(message, cut_marker if index == last else None, parts)
        for index, message in enumerate(conversation.messages)
    ]
    tools = [tool_signature(tool) for tool in conversation.tools] or None
    variables: dict[str, Any] = {
        "messages": _plain_data(messages),
        "tools": _plain_data(tools),
        "documents": None,
        "add_generation_prompt": options.add_generation_prompt and cut_marker is None,
    }
    if options.bos_token is not None:
        variables["bos_token"] = TemplateText.literal(options.bos_token)
    if options.eos_token is not None:
        variables["eos_token"] = TemplateText.literal(options.eos_token)
    if conversation.thinking is not None:
        variables["enable_thinking"] = conversation.thinking
    if conversation.reasoning_effort is not None:  # a template knows up to max: xhigh is max
        effort = conversation.reasoning_effort
        variables["reasoning_effort"] = "max" if effort == "xhigh" else effort
    return variables


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compiled once per distinct template text; models share a template often."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise PromptFormatError(f"the chat template does not compile: {exc}") from exc


def read_chat_template(value: str) -> str:
    """The template a ``--chat-template`` value names, read as vLLM reads it.

    A file's text when ``value`` names one; else, when it holds Jinja's
    braces or a line break, the template itself in single-line form, whose
    ``\\n`` and ``\\t`` escapes stand for a line break and a tab. Anything
    else is a missing file. The text is compiled here, so a bad template
    fails at start-up rather than on every request.
    """
    if _is_file(value):
        text = Path(value).expanduser().read_text(encoding="utf-8")
    elif any(mark in value for mark in ("{", "}", "\n")):
        text = value.replace("\\n", "\n").replace("\\t", "\t")
    else:
        raise PromptFormatError(f"the chat template {value!r} is neither a file nor a template")
    compile_template(text)
    return text


def _is_file(value: str) -> bool:
    try:
        return Path(value).expanduser().is_file()
    except (OSError, ValueError, RuntimeError):  # a template too long for a name, a NUL byte
        return False


def _render(template: jinja2.Template, variables: dict[str, Any]) -> str:
    try:
        return template.render(**variables)
    except TemplateRaised as exc:
        raise ConversationError(
            f"the model's chat template rejected the conversation: {exc.message}"
        ) from exc
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
        # A template that cannot handle this conversation's shape (say, list
        # content with images) is the model's configuration at fault, reported
        # as such rather than as an unexplained crash.
        raise PromptFormatError(f"the chat template failed to render: {exc}") from exc


def _message_dict(message: Message, cut_marker: str | None, parts: bool) -> dict[str, Any]:
    match message:
        case SystemMessage():
            text = text_of(message.content)
            return {"role": "system", "content": _text_parts(text) if parts else text}
        case UserMessage():
            return {"role": "user", "content": _content(message.content, parts)}
        case AssistantMessage():
            return _assistant_dict(message, cut_marker, parts)
        case ToolMessage():
            result: dict[str, Any] = {
                "role": "tool",
                "tool_call_id": message.tool_call_id,
                "content": _content(message.content, parts),
            }
            if message.name is not None:
                result["name"] = message.name
            return result
    raise ConversationError(f"cannot render a {type(message).__name__}")


def _assistant_dict(
    message: AssistantMessage, cut_marker: str | None, parts: bool
) -> dict[str, Any]:
    """transformers' shape; the reasoning goes under both names templates read."""
    text = text_of(message.content) + (cut_marker or "")
    result: dict[str, Any] = {"role": "assistant", "content": _text_parts(text) if parts else text}
    if message.reasoning is not None:
        result["reasoning_content"] = message.reasoning
        result["thinking"] = message.reasoning
    if message.tool_calls:
        result["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": parsed_arguments(call.arguments)},
            }
            for call in message.tool_calls
        ]
    return result


def _plain_data(value: Any) -> Any:
    """Request data rebuilt from exact JSON types.

    Only the template's own strings may be ``TemplateText``; rebuilding every
    string as an exact ``str`` makes sure nothing from a request arrives
    looking like one, whatever object a parser handed over.
    """
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, dict):
        return {_plain_data(key): _plain_data(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain_data(item) for item in value]
    return value


def _content(content: list[ContentPart], parts: bool) -> str | list[dict[str, Any]]:
    """Typed parts when asked or when there are images, else one string."""
    if not parts and not has_images(content):
        return text_of(content)
    return [
        {"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"}
        for part in content
    ]


def _text_parts(text: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text}] if text else []


def resolved_content_format(options: RenderOptions) -> ContentFormat:
    """``options.content_format``, with ``auto`` decided by what the template reads."""
    if options.content_format != "auto":
        return options.content_format
    return content_format(options.chat_template or "")


@lru_cache(maxsize=16)
def content_format(source: str) -> ContentFormat:
    """``openai`` when the template loops over a message's content (it expects a list of
    typed parts), else ``string``; the rule vLLM applies.

    A message is the target of a loop over ``messages``, or over a variable
    set from it (``loop_messages = messages[1:]``); its content is
    ``message.content`` or ``message['content']``, filtered or sliced or not.
    """
    try:
        tree = _environment().parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    lists = _names_set_from(tree, "messages")
    messages = {
        loop.target.name
        for loop in tree.find_all(nodes.For)
        if isinstance(loop.target, nodes.Name) and any(_reads(loop.iter, name) for name in lists)
    }
    for loop in tree.find_all(nodes.For):
        if any(_reads(loop.iter, name, "content") for name in messages):
            return "openai"
    return "string"


def _names_set_from(tree: nodes.Template, name: str) -> set[str]:
    """``name`` and every variable set, directly or in turn, from it."""
    names, pending = {name}, [name]
    while pending:
        source = pending.pop()
        for assign in tree.find_all(nodes.Assign):
            target = assign.target
            if (
                isinstance(target, nodes.Name)
                and target.name not in names
                and _reads(assign.node, source)
            ):
                names.add(target.name)
                pending.append(target.name)
    return names


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether ``node`` is the variable ``name`` (or its ``key``), through filters, tests
    and slices."""
    if isinstance(node, nodes.Filter | nodes.Test):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return isinstance(node, nodes.Name) and node.name == name
    if isinstance(node, nodes.Getattr):
        return node.attr == key and _reads(node.node, name)
    if isinstance(node, nodes.Getitem):
        return (
            isinstance(node.arg, nodes.Const) and node.arg.value == key and _reads(node.node, name)
        )
    return False


def _continuation_marker() -> str:
    """Appended to the continued message so the prompt can be cut right after it.

    Private-use characters plus a random nonce: no user text contains it, and
    unlike searching for the content itself it survives templates that trim.
    """
    return f"\ue000continue-{uuid.uuid4().hex}\ue001"


def _cut_at(text: str, marker: str) -> str:
    if text.count(marker) != 1:
        raise ConversationError(
            "messages[-1].prefix: this model's chat template does not render the assistant "
            "message being continued, so it cannot be continued"
        )
    return text[: text.index(marker)]


# --- the environment -----------------------------------------------------------


class _TemplateTextGenerator(CodeGenerator):
    """Emits every string constant as ``TemplateText`` and joins with spans kept."""

    def visit_Const(self, node: nodes.Const, frame: Frame) -> None:
        value = node.as_const(frame.eval_ctx)
        if not isinstance(value, str | list | tuple | dict):
            super().visit_Const(node, frame)
            return
        self.write(f"environment.template_literal({value!r})")

    def visit_TemplateData(self, node: nodes.TemplateData, frame: Frame) -> None:
        self.write(f"environment.template_literal({node.data!r})")

    def _output_const_repr(self, group: Any) -> str:
        return f"environment.template_literal({super()._output_const_repr(group)})"

    def write_commons(self) -> None:
        # ``~`` compiles to str_join; rebinding it here keeps spans through it.
        super().write_commons()
        self.writeline("str_join = environment.join_strings")
        self.writeline("markup_join = environment.join_strings")


class _GenerationTag(Extension):
    """``{% generation %}…{% endgeneration %}`` (assistant-mask templates): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    code_generator_class = _TemplateTextGenerator
    concat = staticmethod(join_text)
    template_literal = staticmethod(mark_literal)

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        # A template sees TemplateText as a plain string: its span bookkeeping is hidden.
        if isinstance(obj, TemplateText) and not hasattr(str, attr):
            return False
        return super().is_safe_attribute(obj, attr, value)

    @staticmethod
    def join_strings(values: Any) -> str:
        return join_text(map(str, values))


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=1)
def _environment() -> _ChatTemplateEnvironment:
    environment = _ChatTemplateEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


__all__ = [
    "JinjaFormat",
    "TemplateRaised",
    "compile_template",
    "template_special_ranges",
    "template_variables",
]
