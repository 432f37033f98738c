"""The syntaxes a model writes tool calls in: a registry entry's ``tool_parser``, vLLM's
``--tool-call-parser``."""

from __future__ import annotations

from typing import Literal

ToolCallSyntax = Literal["hermes", "llama3_json"]
TOOL_CALL_SYNTAXES: tuple[str, ...] = ("hermes", "llama3_json")
