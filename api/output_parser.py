"""Protocol-neutral incremental parsing of generated text.

The engine streams text in arbitrary chunks; the protocols want answer text,
reasoning text and tool calls as they happen. ``OutputParser`` turns the chunks
into deltas that no protocol owns, so the OpenAI and Anthropic chunk generators
(and non-stream accumulation, through ``merge_deltas``) share one parser.

Contract: however the text is cut into chunks, ``merge_deltas`` of all the
deltas is the same. To keep that and stay linear, only a held-back tail is ever
looked at twice: the longest suffix that could still become a delimiter or a
lead of a bare JSON call (at most the longest of them minus one character),
or, inside a tool call, a possible start of the closing delimiter.

Stop strings are not looked for here: the engine's detokenizer owns them. It
ends the generation at the first one, so the text that reaches the parser
stops before it, and the ``Finish`` event names the string.

Tool calls come in one of three syntaxes. ``tool_calls`` delimiters (Hermes,
Qwen): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` anywhere in
the content. ``bare_json_tool_calls`` (Llama 3): the answer itself is the
calls, ``{"name": ..., "parameters": {...}}`` objects joined by ``;``. With
``dsml_tool_calls`` (DeepSeek) the delimiters open a block of DSML invokes
(``shared.dsml``), held until the block closes and read as one call each; the
block ends the turn, and the newlines before it are dropped. A block that holds
anything else is shown as content.

Choices worth knowing:

- Reasoning delimiters are recognised anywhere in content; inside reasoning
  only the closing one is. Tool markup inside reasoning is reasoning text,
  and reasoning never closed stays reasoning.
- The earliest marker wins; at one position the shortest. A match waits
  while a longer candidate could still start before it.
- Whitespace at the start of the content that follows reasoning or a tool call
  (and, with bare JSON calls, at the start of the answer) is the template's
  formatting, not the answer: it is dropped.
- A tool call body of the shape ``{"name": ..., "arguments": {...}}`` streams
  its arguments verbatim as they arrive; text between the arguments and the
  closing delimiter is ignored. Any other body is held until the closing
  delimiter (looked for verbatim, strings or not) and parsed as a whole JSON
  object (key order free, ``parameters`` accepted, string arguments passed as
  they are); if that fails too, the markup is shown as content.
- At ``finish()`` an unterminated streamed call is closed (its arguments may be
  cut short, the finish reason says why); an unterminated held body gets the
  whole-object attempt and otherwise becomes content.
- A bare JSON call starts where the answer does (the start of the text, the
  end of reasoning) when only whitespace comes before its ``{`` or
  ``<|python_tag|>{``, and right after a bare call when only whitespace and
  then at most ``;`` or ``; `` do. Its object is held until its brackets
  balance and parsed whole: with a string ``name`` and an ``arguments`` or
  ``parameters`` key it is a call; otherwise it, its lead and all that follows
  are plain content. An object still open at ``finish()`` is content too.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from enum import Enum

from api.json_scanner import JsonValueScanner, PreludeStatus, ToolCallPrelude
from shared import dsml

_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass(slots=True, frozen=True)
class ContentDelta:
    text: str


@dataclass(slots=True, frozen=True)
class ReasoningDelta:
    text: str


@dataclass(slots=True, frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(slots=True, frozen=True)
class ToolCallArgsDelta:
    index: int
    text: str


@dataclass(slots=True, frozen=True)
class ToolCallEnd:
    index: int


@dataclass(slots=True, frozen=True)
class ToolCallsDone:
    """The one tool call a ``single_tool_call`` request allows has ended: so has the answer."""


Delta = (
    ContentDelta | ReasoningDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd | ToolCallsDone
)


def merge_deltas(deltas: Iterable[Delta]) -> list[Delta]:
    """Join adjacent text deltas of the same kind (and tool call); drop empty ones."""
    merged: list[Delta] = []
    for delta in deltas:
        if isinstance(delta, ContentDelta | ReasoningDelta | ToolCallArgsDelta):
            if not delta.text:
                continue
            last = merged[-1] if merged else None
            if type(last) is type(delta) and _index(last) == _index(delta):
                merged[-1] = replace(delta, text=last.text + delta.text)
                continue
        merged.append(delta)
    return merged


def _index(delta: Delta | None) -> int | None:
    return getattr(delta, "index", None)


def new_tool_call_id() -> str:
    """``call_`` and 24 random letters or digits, the shape OpenAI clients expect."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(slots=True, frozen=True)
class Delimiters:
    open: str
    close: str


THINK = Delimiters("<think>", "</think>")
HERMES_TOOL_CALL = Delimiters("<tool_call>", "</tool_call>")
_PYTHON_TAG = "<|python_tag|>"  # Llama 3's token in front of a tool call

# What opens a bare JSON call where the answer starts, and between two calls.
_ANSWER_CALL_LEADS = frozenset({"{", _PYTHON_TAG + "{"})
_NEXT_CALL_LEADS = frozenset({"{", ";{", "; {"})


@dataclass(slots=True)
class ParserConfig:
    """What to look for. ``None`` delimiters mean the feature is off for this
    request, and its markup is plain content."""

    reasoning: Delimiters | None = None
    starts_in_reasoning: bool = False  # the prompt already opened the reasoning block
    tool_calls: Delimiters | None = None
    bare_json_tool_calls: bool = False  # an answer that starts with ``{`` is tool calls (Llama 3)
    dsml_tool_calls: bool = False  # the tool_calls block holds DSML invokes (DeepSeek)
    starts_in_tool_calls: bool = False  # the prompt opened a DSML tool_calls block
    single_tool_call: bool = False  # stop parsing (and generating) after the first call

    def __post_init__(self) -> None:
        if self.starts_in_reasoning and self.reasoning is None:
            raise ValueError("starts_in_reasoning=True needs reasoning delimiters, got None")
        for name, pair in (("reasoning", self.reasoning), ("tool_calls", self.tool_calls)):
            if pair is not None and (not pair.open or not pair.close or pair.open == pair.close):
                raise ValueError(
                    f"{name} delimiters must be two different non-empty strings, got {pair!r}"
                )
        if self.dsml_tool_calls and self.tool_calls is None:
            raise ValueError("dsml_tool_calls=True needs tool_calls delimiters, got None")
        if self.starts_in_tool_calls and not self.dsml_tool_calls:
            raise ValueError("starts_in_tool_calls=True is for DSML tool calls")


@dataclass(slots=True)
class _MarkerFinder:
    """Finds the earliest of several strings, holding back a possible partial one."""

    markers: frozenset[str]
    _pattern: re.Pattern[str] = field(init=False)
    _longest: int = field(init=False)

    def __post_init__(self) -> None:
        by_length = sorted(self.markers, key=len)  # at one position the shortest wins
        self._pattern = re.compile("|".join(map(re.escape, by_length)) or r"(?!)")
        self._longest = len(by_length[-1]) if by_length else 0

    def find(self, text: str, pos: int) -> tuple[int, str | None]:
        """Return (end of the text safe to pass on, the marker found there or None).

        A marker is taken only if no longer one could still start before it.
        """
        match = self._pattern.search(text, pos)
        limit = match.start() if match else len(text)
        for start in range(max(pos, len(text) - self._longest + 1), limit):
            tail = text[start:]
            if any(len(marker) > len(tail) and marker.startswith(tail) for marker in self.markers):
                return start, None
        return (limit, match.group()) if match else (limit, None)


class _State(Enum):
    CONTENT = "content"
    REASONING = "reasoning"
    PRELUDE = "prelude"  # inside a tool call, before the arguments
    ARGUMENTS = "arguments"  # streaming the arguments object
    TAIL = "tail"  # after the arguments, waiting for the closing delimiter
    HELD = "held"  # an unexpected body, kept whole until the closing delimiter
    ANSWER_START = "answer start"  # content, blank so far, that may still be bare JSON calls
    NEXT_CALL = "next call"  # after a bare JSON call, before what follows it
    OBJECT = "object"  # a bare JSON object, kept whole until its brackets balance
    STOPPED = "stopped"


class OutputParser:
    """Feeds on text chunks, returns deltas; see the module docstring for the rules."""

    def __init__(
        self, config: ParserConfig, id_factory: Callable[[], str] = new_tool_call_id
    ) -> None:
        self._config = config
        self._new_id = id_factory
        self._answer_start = _State.ANSWER_START if config.bare_json_tool_calls else _State.CONTENT
        self._state = _State.REASONING if config.starts_in_reasoning else self._answer_start
        if config.starts_in_tool_calls:
            self._state = _State.HELD
        self._finders = _finders(config)
        self._held = ""
        self._out: list[Delta] = []
        self._strip_content = config.bare_json_tool_calls
        self._calls = 0
        self._body: list[str] = []
        self._lead = ""
        self._prelude = ToolCallPrelude()
        self._arguments = JsonValueScanner()
        self._handlers: dict[_State, Callable[[str, int], int]] = {
            _State.CONTENT: self._scan_text,
            _State.REASONING: self._scan_text,
            _State.PRELUDE: self._read_prelude,
            _State.ARGUMENTS: self._read_arguments,
            _State.TAIL: self._read_tail,
            _State.HELD: self._read_held_body,
            _State.ANSWER_START: self._scan_answer_start,
            _State.NEXT_CALL: self._scan_answer_start,
            _State.OBJECT: self._read_object,
        }

    def push(self, text: str) -> list[Delta]:
        """Parse one more chunk; text that may start a delimiter waits for the next."""
        buffer, pos = self._held + text, 0
        handlers = self._handlers
        while pos < len(buffer) and self._state is not _State.STOPPED:
            state = self._state
            new_pos = handlers[state](buffer, pos)
            if new_pos == pos and self._state is state:
                break
            pos = new_pos
        self._held = buffer[pos:] if self._state is not _State.STOPPED else ""
        return self._take()

    def finish(self) -> list[Delta]:
        """Flush what was held back at the end of generation."""
        held, self._held = self._held, ""
        if self._state in (_State.CONTENT, _State.ANSWER_START, _State.NEXT_CALL):
            self._content(held)
        elif self._state is _State.REASONING:
            self._emit(ReasoningDelta(held))
        elif self._state in (_State.PRELUDE, _State.HELD):
            self._body.append(held)
            self._resolve_held_body(closed=False)
        elif self._state in (_State.ARGUMENTS, _State.TAIL):
            self._end_call()
        elif self._state is _State.OBJECT:
            self._body.append(held)
            self._resolve_object()
        self._state = _State.STOPPED
        return self._take()

    def _scan_text(self, buffer: str, pos: int) -> int:
        end, marker = self._finders[self._state].find(buffer, pos)
        text = buffer[pos:end]
        if self._state is _State.CONTENT and self._config.dsml_tool_calls:
            kept = text.rstrip("\n")  # newlines before a DSML block are its formatting
            if marker is None:  # held until what follows them shows
                self._content(kept)
                return pos + len(kept)
            if self._config.tool_calls is not None and marker == self._config.tool_calls.open:
                text = kept
        if self._state is _State.CONTENT:
            self._content(text)
        else:
            self._emit(ReasoningDelta(text))
        if marker is None:
            return end
        if self._state is _State.REASONING:
            self._state, self._strip_content = self._answer_start, True
        elif self._config.reasoning is not None and marker == self._config.reasoning.open:
            self._state = _State.REASONING
        elif self._config.dsml_tool_calls:
            self._state, self._body = _State.HELD, []
        else:
            self._state, self._body = _State.PRELUDE, []
            self._prelude = ToolCallPrelude()
        return end + len(marker)

    def _scan_answer_start(self, buffer: str, pos: int) -> int:
        """Whitespace, then a lead that opens a bare JSON call, or else plain content.

        The content markers are a subset of this state's, so the text passed on
        before a hand-over is text the content state would have passed on too.
        """
        end, marker = self._finders[self._state].find(buffer, pos)
        text = buffer[pos:end]
        self._content(text)
        leads = _ANSWER_CALL_LEADS if self._state is _State.ANSWER_START else _NEXT_CALL_LEADS
        opens_call = marker in leads
        if (text and not text.isspace()) or (marker is not None and not opens_call):
            self._state = _State.CONTENT  # the answer is text: the content state takes the marker
            return end
        if marker is None:
            return end
        brace = end + len(marker) - 1
        self._state, self._lead, self._body = _State.OBJECT, buffer[end:brace], []
        self._arguments = JsonValueScanner()
        return brace

    def _read_object(self, buffer: str, pos: int) -> int:
        end = self._arguments.feed(buffer, pos)
        self._body.append(buffer[pos:end])
        if end is None:
            return len(buffer)
        self._resolve_object()
        return end

    def _resolve_object(self) -> None:
        """A whole bare JSON object: a call, or (with its lead) the content it was."""
        body = "".join(self._body)
        call = _parse_call(body, arguments_required=True)
        if call is None:
            self._state = _State.CONTENT
            self._content(self._lead + body)
            return
        self._state = _State.NEXT_CALL
        self._whole_call(*call)

    def _read_prelude(self, buffer: str, pos: int) -> int:
        end = self._prelude.feed(buffer, pos)
        self._body.append(buffer[pos:end])
        if self._prelude.status is PreludeStatus.FAILED:
            self._state = _State.HELD
        elif self._prelude.status is PreludeStatus.DONE:
            self._emit(ToolCallStart(self._calls, self._new_id(), self._prelude.name or ""))
            self._state, self._arguments = _State.ARGUMENTS, JsonValueScanner()
        return end

    def _read_arguments(self, buffer: str, pos: int) -> int:
        end = self._arguments.feed(buffer, pos)
        if end is None:
            end = len(buffer)
        else:
            self._state = _State.TAIL
        self._emit(ToolCallArgsDelta(self._calls, buffer[pos:end]))
        return end

    def _read_tail(self, buffer: str, pos: int) -> int:
        end, marker = self._finders[_State.TAIL].find(buffer, pos)
        if marker is None:
            return end
        self._state = _State.CONTENT
        self._end_call()
        return end + len(marker)

    def _read_held_body(self, buffer: str, pos: int) -> int:
        end, marker = self._finders[_State.TAIL].find(buffer, pos)
        self._body.append(buffer[pos:end])
        if marker is None:
            return end
        self._state = _State.CONTENT
        self._resolve_held_body(closed=True)
        return end + len(marker)

    def _resolve_held_body(self, closed: bool) -> None:
        """Emit a buffered body as its whole calls, or as the content it was."""
        body = "".join(self._body)
        if self._config.dsml_tool_calls:
            calls = dsml.parse_calls(body) if closed else None
        else:
            call = _parse_call(body)
            calls = None if call is None else [call]
        if calls is not None:
            for call in calls:
                if self._state is _State.STOPPED:  # one call was allowed
                    break
                self._whole_call(*call)
            if self._config.dsml_tool_calls and self._state is not _State.STOPPED:
                self._emit(ToolCallsDone())  # a DSML block ends the turn
                self._state = _State.STOPPED
            return
        delimiters = self._config.tool_calls
        assert delimiters is not None
        self._content(delimiters.open + body + (delimiters.close if closed else ""))

    def _whole_call(self, name: str, arguments: str) -> None:
        self._emit(ToolCallStart(self._calls, self._new_id(), name))
        self._emit(ToolCallArgsDelta(self._calls, arguments))
        self._end_call()

    def _end_call(self) -> None:
        self._emit(ToolCallEnd(self._calls))
        self._calls += 1
        self._strip_content = True
        if self._config.single_tool_call:
            self._emit(ToolCallsDone())
            self._state = _State.STOPPED

    def _content(self, text: str) -> None:
        if self._strip_content:
            text = text.lstrip()
            self._strip_content = not text
        self._emit(ContentDelta(text))

    def _emit(self, delta: Delta) -> None:
        if getattr(delta, "text", None) != "":
            self._out.append(delta)

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out


def _finders(config: ParserConfig) -> dict[_State, _MarkerFinder]:
    """The strings live in each state that searches for markers."""
    content: set[str] = set()
    reasoning: set[str] = set()
    tail: set[str] = set()
    if config.reasoning is not None:
        content.add(config.reasoning.open)
        reasoning.add(config.reasoning.close)
    if config.tool_calls is not None:
        content.add(config.tool_calls.open)
        tail.add(config.tool_calls.close)
    return {
        _State.CONTENT: _MarkerFinder(frozenset(content)),
        _State.ANSWER_START: _MarkerFinder(frozenset(content | _ANSWER_CALL_LEADS)),
        _State.NEXT_CALL: _MarkerFinder(frozenset(content | _NEXT_CALL_LEADS)),
        _State.REASONING: _MarkerFinder(frozenset(reasoning)),
        _State.TAIL: _MarkerFinder(frozenset(tail)),
    }


def _parse_call(body: str, *, arguments_required: bool = False) -> tuple[str, str] | None:
    """(name, arguments JSON) from a whole body, or None if it is not a call."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if arguments_required and not {"arguments", "parameters"} & value.keys():
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return value["name"], arguments
