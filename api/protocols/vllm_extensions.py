"""vLLM's extension fields, read the same way by every protocol that accepts them.

``structured_outputs`` is accepted on all three protocols, so
``extra_body={"structured_outputs": {...}}`` works as it does against vLLM.
``min_tokens``, ``ignore_eos``, ``stop_token_ids`` are Chat Completions
extensions, as in vLLM. Token ids are checked against the vocabulary in
preparation, where the model is known.
"""

from __future__ import annotations

import json
from typing import Any

from api.errors import bad_request
from api.protocols.openai_common import Fields, show
from shared.sampling import MAX_LOGIT_BIAS, StructuredOutputs

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


def read_token_ids(fields: Fields, name: str) -> list[int]:
    value = fields.array(name) or []
    if not all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        raise fields.error(name, "an array of token ids (integers)")
    return list(value)


def read_logit_bias(fields: Fields) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token ids (as JSON object keys) to a bias in [-100, 100]."""
    value = fields.get("logit_bias")
    if value is None:
        return {}
    accepted = "an object mapping token ids to numbers between -100 and 100"
    if not isinstance(value, dict):
        raise fields.error("logit_bias", accepted)
    bias: dict[int, float] = {}
    for key, item in value.items():
        ok = isinstance(key, str) and key.strip().lstrip("-").isdigit()
        ok = ok and isinstance(item, int | float) and not isinstance(item, bool)
        if not ok or abs(item) > MAX_LOGIT_BIAS:
            raise fields.error("logit_bias", accepted)
        bias[int(key)] = float(item)
    return bias


def _schema(text: str, where: str) -> dict[str, Any]:
    try:
        schema = json.loads(text)
    except ValueError:
        schema = None
    if not isinstance(schema, dict):
        raise bad_request(f"{where} must be a JSON schema object, got {show(text)}", where)
    return schema
