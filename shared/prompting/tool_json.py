"""Tools and tool calls as the JSON that chat templates show the model.

Templates trained on Hugging Face's conventions expect each tool as
``{"type": "function", "function": {...}}`` and tool-call arguments as an
object serialised like ``tojson`` (``json.dumps`` with ``ensure_ascii=False``).
Hand-written formats and the Jinja format share these so both lay tools out
the same way.
"""

from __future__ import annotations

import json
from typing import Any

from shared.conversation import Tool


def dumps(value: Any, indent: int | None = None) -> str:
    """Serialise like transformers' ``tojson`` filter: non-ASCII kept, default separators."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


def tool_signature(tool: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.parameters
    return {"type": "function", "function": function}


def parsed_arguments(arguments: str) -> Any:
    """The arguments as a JSON object when they are one, else the original text.

    Templates serialise an object themselves; text that is not a JSON object
    (a model's malformed call echoed back) is passed through untouched.
    """
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def arguments_text(arguments: str) -> str:
    """Arguments normalised to ``tojson`` spacing when they parse, verbatim otherwise."""
    value = parsed_arguments(arguments)
    return value if isinstance(value, str) else dumps(value)
