"""vLLM's ``structured_outputs``, read the same way by every protocol that accepts it.

It is accepted on every generation protocol, so
``extra_body={"structured_outputs": {...}}`` works as it does against vLLM. The
request models check its fields' types; this reader checks that exactly one
known constraint is given and reads a JSON schema sent as text.
"""

from __future__ import annotations

import json
from typing import Any

from api.errors import bad_request
from api.protocols.openai_common import show
from shared.sampling import StructuredOutputs

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def read_structured_outputs(
    value: Any, where: str = "structured_outputs"
) -> StructuredOutputs | None:
    """``{"json" | "json_object" | "regex" | "choice" | "grammar": ...}``, exactly one of them."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"{where} must be an object, got {show(value)}", where)
    for name in value:
        if name not in STRUCTURED_KINDS and value[name] is not None:
            raise bad_request(
                f"{where}.{name} is not supported; the supported fields are "
                f"{', '.join(STRUCTURED_KINDS)}",
                f"{where}.{name}",
            )
    given = {name: value[name] for name in STRUCTURED_KINDS if value.get(name) not in (None, False)}
    if isinstance(given.get("json"), str):
        given["json"] = _schema(given["json"], f"{where}.json")
    try:
        return StructuredOutputs(**given)
    except (TypeError, ValueError) as exc:
        raise bad_request(str(exc), where) from None


def _schema(text: str, where: str) -> dict[str, Any]:
    try:
        schema = json.loads(text)
    except ValueError:
        schema = None
    if not isinstance(schema, dict):
        raise bad_request(f"{where} must be a JSON schema object, got {show(text)}", where)
    return schema
