"""DeepSeek's DSML tool calls: how each model version spells them, and the invokes inside
one ``tool_calls`` block read as calls.

A block holds one ``invoke`` per call and one ``parameter`` per argument::

    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>

(V4.1 writes ``｜DSML｜`` followed by a space.) ``string="true"`` marks a value that is the
string as written; any other value is JSON, and goes into the arguments as written. The
arguments are the JSON object of the parameters in order, spelled as deepseek-recipe's
stream processor spells them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

DSML = "｜DSML｜"

_INVOKE = re.compile(
    rf'<{DSML} ?invoke name="(?P<name>[^"]*)">(?P<body>.*?)</{DSML} ?invoke>', re.DOTALL
)
_PARAMETER = re.compile(
    rf'<{DSML} ?parameter name="(?P<name>[^"]*)" string="(?P<string>true|false)">'
    rf"(?P<value>.*?)</{DSML} ?parameter>",
    re.DOTALL,
)


@dataclass(frozen=True, slots=True)
class Markup:
    """One model version's DSML spelling: ``tag`` leads every element's name."""

    tag: str
    block: str

    @property
    def block_delimiters(self) -> tuple[str, str]:
        """The ``tool_calls`` block's opening and closing markup."""
        return f"<{self.tag}{self.block}>", f"</{self.tag}{self.block}>"

    def invoke(self, name: str) -> str:
        return f'<{self.tag}invoke name="{name}">'

    @property
    def invoke_close(self) -> str:
        return f"</{self.tag}invoke>"

    def parameter(self, name: str, string: bool) -> str:
        return f'<{self.tag}parameter name="{name}" string="{"true" if string else "false"}">'

    @property
    def parameter_close(self) -> str:
        return f"</{self.tag}parameter>"


MARKUPS = {"deepseek_v4": Markup(DSML, "tool_calls"), "deepseek_v4.1": Markup(DSML + " ", "calls")}
"""Each DeepSeek prompt format's spelling, as deepseek-recipe renders it."""


def parse_calls(body: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each invoke in a block's ``body``, or None when the body
    holds anything but invokes (and whitespace between them)."""
    calls: list[tuple[str, str]] = []
    end = 0
    for invoke in _INVOKE.finditer(body):
        if body[end : invoke.start()].strip():
            return None
        arguments = _arguments(invoke.group("body"))
        if arguments is None:
            return None
        calls.append((invoke.group("name"), arguments))
        end = invoke.end()
    if body[end:].strip() or not calls:
        return None
    return calls


def _arguments(body: str) -> str | None:
    fields: list[str] = []
    end = 0
    for parameter in _PARAMETER.finditer(body):
        if body[end : parameter.start()].strip():
            return None
        value = parameter.group("value")
        if parameter.group("string") == "true":
            value = json.dumps(value, ensure_ascii=False)
        fields.append(f"{json.dumps(parameter.group('name'), ensure_ascii=False)}: {value}")
        end = parameter.end()
    if body[end:].strip():
        return None
    return "{" + ", ".join(fields) + "}"
