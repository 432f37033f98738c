"""Incremental JSON scanning for streamed tool calls.

A Qwen/Hermes tool call body is ``{"name": "...", "arguments": {...}}``. To
stream the arguments while they are generated we do not need a JSON parser,
only two small state machines that remember where they are between chunks:

- ``ToolCallPrelude`` reads ``{"name": <string>, "arguments":`` and stops in
  front of the arguments value, so the name is known before any argument text.
- ``JsonValueScanner`` follows one object or array, aware of strings and
  escapes, and reports the position just after its closing bracket.

Both look at each character once, whatever the chunking.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import Enum

_WHITESPACE = frozenset(" \t\n\r")
_ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3 style bodies say "parameters"
_NAME_KEY = '"name"'
_ARGUMENTS_KEY = '"arguments"'
_NAME = "name"
_VALUE = "value"
# The expected tokens of the prelude, in order; quoted entries are keys.
_STEPS = ("{", _NAME_KEY, ":", _NAME, ",", _ARGUMENTS_KEY, ":", _VALUE)
_STRUCTURAL = re.compile(r'["\\{}\[\]]')


class PreludeStatus(Enum):
    PENDING = "pending"  # still reading, nothing contradicts the expected shape
    DONE = "done"  # stopped in front of the arguments object; ``name`` is set
    FAILED = "failed"  # the body has another shape: the caller falls back


@dataclass(slots=True)
class ToolCallPrelude:
    """Reads ``{"name": <string>, "arguments":`` across any number of chunks.

    It only accepts that key order and an object as the arguments value: that
    is what the models emit, and anything else is left to the caller's
    buffered fallback rather than guessed at here.
    """

    status: PreludeStatus = PreludeStatus.PENDING
    name: str | None = None
    _step: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _raw: list[str] = field(default_factory=list)

    def feed(self, text: str, pos: int) -> int:
        """Consume ``text[pos:]`` up to a verdict; return where reading stopped.

        On DONE the returned position is the arguments' opening brace, which is
        left for the value scanner. On FAILED it is the offending character.
        """
        for index in range(pos, len(text)):
            char = text[index]
            if self._in_string:
                self._string_char(char)
                if self.status is PreludeStatus.FAILED:
                    return index + 1
            elif char not in _WHITESPACE:
                self._token_start(char)
                if self.status is not PreludeStatus.PENDING:
                    return index
        return len(text)

    def _token_start(self, char: str) -> None:
        expected = _STEPS[self._step]
        if expected == _VALUE:
            self.status = PreludeStatus.DONE if char == "{" else PreludeStatus.FAILED
        elif expected in (_NAME_KEY, _ARGUMENTS_KEY, _NAME) and char == '"':
            self._in_string = True
            self._raw.clear()
        elif char == expected:
            self._step += 1
        else:
            self.status = PreludeStatus.FAILED

    def _string_char(self, char: str) -> None:
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == '"':
            self._in_string = False
            self._string_done()
            return
        self._raw.append(char)

    def _string_done(self) -> None:
        try:
            value = json.loads('"' + "".join(self._raw) + '"')
        except ValueError:
            self.status = PreludeStatus.FAILED
            return
        expected = _STEPS[self._step]
        if expected == _NAME:
            self.name = value
        elif (expected == _NAME_KEY and value != "name") or (
            expected == _ARGUMENTS_KEY and value not in _ARGUMENT_KEYS
        ):
            self.status = PreludeStatus.FAILED
            return
        self._step += 1


@dataclass(slots=True)
class JsonValueScanner:
    """Finds the end of one JSON object or array fed in pieces.

    It counts brackets outside strings and does not validate anything else:
    the text is passed to the client verbatim, so all we need is where it
    stops. An escape split across two chunks is carried in ``_escaped``.
    """

    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    def feed(self, text: str, pos: int) -> int | None:
        """Return the index just after the value's end, or None if it goes on."""
        if self._escaped and pos < len(text):
            self._escaped = False
            pos += 1
        skip = -1
        for match in _STRUCTURAL.finditer(text, pos):
            index = match.start()
            if index == skip:
                continue
            char = match.group()
            if self._in_string:
                if char == "\\":
                    skip = index + 1
                    self._escaped = skip == len(text)
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return index + 1
        return None
