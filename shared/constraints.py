"""Constraints as llguidance grammars: built and checked in the API, matched in the engine.

Every constraint a request can carry (a JSON schema, any JSON object, a
regex, a choice, a Lark grammar, a forced tool call) becomes one grammar in
llguidance's JSON grammar format. That text is the constraint's compact form:
it travels in ``SamplingParams.structured_outputs.grammar``, and an engine
compiles it once per distinct text.

JSON is written the way ``json.dumps`` writes it (``", "`` and ``": "``, no
other whitespace): a model cannot pad an object with newlines until it runs
out of tokens, and the output reads like the JSON it was trained on.

An object schema that names its properties and says nothing of others is
closed: ``additionalProperties`` defaults to false, as XGrammar reads it and as
pydantic, instructor and most tool definitions mean it (they leave it out).
Under JSON Schema's own reading a model may add keys the schema never named
until it runs out of tokens; ``additional_properties=True`` restores it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import llguidance

from shared import dsml
from shared.sampling import StructuredOutputs
from shared.tokenizer_loader import LoadedTokenizer
from shared.tool_syntax import ToolCallSyntax

JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
ANY_OBJECT: dict[str, Any] = {"type": "object"}

# Keywords whose value is one subschema, a list of them, or a map of name to subschema.
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class ConstraintError(ValueError):
    """A constraint the grammar engine refuses; the message is its own, prefixed by the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """What a forced tool call needs of one tool: its name and its arguments' schema."""

    name: str
    parameters: dict[str, Any]


_lltokenizers: dict[tuple[int, int], llguidance.LLTokenizer] = {}


def lltokenizer(
    tokenizer: LoadedTokenizer, vocab_size: int | None = None
) -> llguidance.LLTokenizer:
    """llguidance's view of a tokenizer (a fraction of a second to build; built once).

    ``vocab_size`` is the model's logits width when it exceeds the tokenizer's.
    The model's stop tokens are the grammar's end-of-sequence tokens.
    """
    size = vocab_size or tokenizer.tokenizer.get_vocab_size()
    key = (id(tokenizer), size)
    if key not in _lltokenizers:
        _lltokenizers[key] = llguidance.LLTokenizer(
            tokenizer.tokenizer.to_str(), n_vocab=size, eos_token=list(tokenizer.stop_token_ids)
        )
    return _lltokenizers[key]


def grammar_of(spec: StructuredOutputs, *, additional_properties: bool = False) -> str:
    """The llguidance grammar (JSON text) for one structured-outputs spec.

    ``additional_properties`` is what an object schema that leaves it out allows.

    ``ConstraintError`` for a spec llguidance cannot take in (an integer past
    64 bits, a string no encoding holds).
    """
    try:
        return _grammar_of(spec, additional_properties)
    except ConstraintError:
        raise
    except BaseException as exc:
        if not _is_grammar_failure(exc):
            raise
        raise ConstraintError("structured_outputs", str(exc)) from None


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that names properties
    and says nothing of others; objects that name none (a free-form dict) stay open."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SUBSCHEMA:
        if key in closed:
            closed[key] = closed_objects(closed[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_objects(item) for item in closed[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_objects(item) for name, item in closed[key].items()}
    if (
        isinstance(closed.get("properties"), dict)
        and "additionalProperties" not in closed
        and "unevaluatedProperties" not in closed
    ):
        closed["additionalProperties"] = False
    return closed


def _grammar_of(spec: StructuredOutputs, additional_properties: bool) -> str:
    if spec.grammar is not None:
        text = spec.grammar.strip()
        return text if text.startswith("{") else _from_lark(text)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return _from_lark("start: " + " | ".join(_literal(option) for option in spec.choice))
    schema = ANY_OBJECT if spec.json_object else spec.json
    if isinstance(schema, str):
        schema = _schema_object(schema)
    if not additional_properties:
        schema = closed_objects(schema)
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def tool_call_grammar(
    tools: Iterable[ToolSpec],
    syntax: ToolCallSyntax,
    *,
    parallel: bool,
    additional_properties: bool = False,
) -> str:
    """One tool call (or, with ``parallel``, one or more) in the model's own syntax.

    ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
    calls separated by a newline. ``llama3_json``: ``{"name": ..., "parameters":
    {...}}``, calls separated by ``"; "``. Each call's arguments match its
    tool's ``parameters`` schema, read as ``grammar_of`` reads one.
    """
    key = "arguments" if syntax == "hermes" else "parameters"
    rules: list[str] = []
    names: list[str] = []
    for index, tool in enumerate(tools):
        rule = f"tool_{index}"
        names.append(rule)
        prefix = json.dumps({"name": tool.name, key: 0}, ensure_ascii=False).removesuffix("0}")
        parameters = tool.parameters if additional_properties else closed_objects(tool.parameters)
        schema = {**parameters, "x-guidance": JSON_OPTIONS}
        rules.append(f'{rule}: {_literal(prefix)} {rule}_args "}}"')
        rules.append(f"{rule}_args: %json {json.dumps(schema, ensure_ascii=False)}")
    if syntax == "hermes":
        call = 'call: "<tool_call>\\n" body "\\n</tool_call>"'
        separator = '"\\n"'
    else:
        call = "call: body"
        separator = '"; "'
    start = f"start: call ({separator} call)*" if parallel else "start: call"
    return _from_lark("\n".join([start, call, "body: " + " | ".join(names), *rules]))


def dsml_tool_call_grammar(
    tools: Iterable[ToolSpec],
    markup: dsml.Markup,
    *,
    parallel: bool,
    opened: bool,
    additional_properties: bool = False,
) -> str:
    """One DSML invoke (or, with ``parallel``, one or more) in a ``tool_calls`` block, laid
    out as deepseek-recipe renders calls; ``opened``: the prompt already opened the block.

    A tool's properties come in its schema's order, the required ones always: a string
    property as the text itself (``string="true"``; an ``enum`` of strings as one of them),
    any other as JSON matching its schema (``string="false"``). A schema that names no
    properties, or leaves others open, takes parameters of any name as well.
    """
    rules: list[str] = []
    invokes: list[str] = []
    for index, tool in enumerate(tools):
        schema = tool.parameters if additional_properties else closed_objects(tool.parameters)
        invoke = f"tool_{index}"
        invokes.append(invoke)
        parameters = []
        required = set(schema.get("required", []))
        for position, (name, subschema) in enumerate(schema.get("properties", {}).items()):
            rule = f"{invoke}_{position}"
            parameters.append(rule if name in required else f"({rule})?")
            rules.append(f"{rule}: {_dsml_parameter(markup, name, subschema, rule, rules)}")
        if schema.get("additionalProperties", True) is not False:
            parameters.append("any_parameter*")
        # V4.1 writes an invoke without parameters with an empty line; either takes one
        body = " ".join([*parameters, '"\\n"?'])
        rules.append(
            f"{invoke}: {_literal(markup.invoke(tool.name) + chr(10))} {body} "
            f"{_literal(markup.invoke_close + chr(10))}"
        )
    open_, close = markup.block_delimiters
    calls = "(call)+" if parallel else "call"
    start = f"start: {'' if opened else _literal(open_ + chr(10))} {calls} {_literal(close)}"
    name_open = _literal("<" + markup.tag + 'parameter name="')
    as_text, as_json = _literal('" string="true">'), _literal('" string="false">')
    any_parameter = (
        f"any_parameter: {name_open} /[A-Za-z0-9_.-]+/ ({as_text} any_text "
        f"| {as_json} any_json {_literal(markup.parameter_close)}) {_literal(chr(10))}"
    )
    lark = [
        start,
        "call: " + " | ".join(invokes),
        *rules,
        any_parameter,
        f"any_text[lazy]: {_until(markup.parameter_close)}",
        f"any_json: %json {json.dumps({'x-guidance': JSON_OPTIONS})}",
    ]
    return _from_lark("\n".join(lark))


def _dsml_parameter(
    markup: dsml.Markup, name: str, schema: Any, rule: str, rules: list[str]
) -> str:
    """The grammar of one parameter line; a lazy text lexeme goes into ``rules``."""
    strings = isinstance(schema, dict) and schema.get("type") == "string"
    head = _literal(markup.parameter(name, string=strings))
    tail = _literal(markup.parameter_close + chr(10))
    if not strings:
        value = json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)
        return f"{head} %json {value} {tail}"
    options = schema.get("enum")
    if isinstance(options, list) and all(isinstance(option, str) for option in options):
        return f"{head} ({' | '.join(_literal(option) for option in options)}) {tail}"
    rules.append(f"{rule}_text[lazy]: {_until(markup.parameter_close)}")
    return f"{head} {rule}_text {_literal(chr(10))}"


def _until(end: str) -> str:
    """A regex for any text up to and including the first ``end``."""
    return "/(?s:.*)" + re.escape(end).replace("/", "\\/") + "/"


def after_reasoning(grammar: str, reasoning_end: str, token: int | None = None) -> str:
    """``grammar`` applied only to what follows the first ``reasoning_end``.

    The reasoning before it is free text: a lazy lexeme ends at the first
    occurrence of the delimiter, and after at most four spaces or newlines the
    answer grammar takes over. Where the vocabulary spells the delimiter as one
    added ``token``, the grammar names that token, as llguidance reads such
    tokens apart from text: the reasoning is any other tokens.
    """
    answer = json.loads(grammar)["grammars"]
    name = answer[0].get("name") or "answer"
    answer[0]["name"] = name
    if token is None:
        gate = f"start: reasoning GAP? @{name}\nreasoning[lazy]: {_until(reasoning_end)}"
    else:
        gate = f"start: reasoning <[{token}]> GAP? @{name}\nreasoning: <[^{token}]>*"
    gate += "\nGAP: /[ \\n]{1,4}/"  # the template's blank line, not padding without end
    return json.dumps({"grammars": [{"lark_grammar": gate}, *answer]}, ensure_ascii=False)


def check(grammar: str, field: str, tokenizer: llguidance.LLTokenizer | None = None) -> None:
    """Raise ``ConstraintError`` for a grammar llguidance refuses or would only partly enforce.

    Warnings (an unknown string ``format``, say) are refusals too: a schema
    feature the engine cannot enforce is never silently relaxed.
    """
    failed, messages = _validated(grammar, tokenizer)
    if failed or messages:
        raise ConstraintError(field, "; ".join(messages) or "the grammar is invalid")


def schema_is_enforceable(schema: dict[str, Any]) -> bool:
    """Whether llguidance enforces every feature of a JSON schema."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except BaseException as exc:
        if not _is_grammar_failure(exc):
            raise
        return False
    failed, messages = _validated(grammar, None)
    return not failed and not messages


@lru_cache(maxsize=1024)
def _validated(
    grammar: str, tokenizer: llguidance.LLTokenizer | None
) -> tuple[bool, tuple[str, ...]]:
    """llguidance's verdict on a grammar, cached: clients send the same schema again and again."""
    try:
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    except BaseException as exc:  # a panic in llguidance's Rust arrives as a BaseException
        if not _is_grammar_failure(exc):
            raise
        return True, (f"the grammar engine could not take this grammar: {exc}",)
    return failed, tuple(messages)


def _is_grammar_failure(exc: BaseException) -> bool:
    """An error of llguidance's about its input, rather than the process being stopped."""
    return isinstance(exc, ValueError | TypeError | OverflowError) or (
        type(exc).__name__ == "PanicException"
    )


def _schema_object(text: str) -> dict[str, Any]:
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise ConstraintError("json", f"the schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ConstraintError("json", "the schema must be a JSON object")
    return schema


def _from_lark(lark: str) -> str:
    return json.dumps({"grammars": [{"lark_grammar": lark}]}, ensure_ascii=False)


def _literal(text: str) -> str:
    """A Lark string literal for ``text`` (llguidance reads JSON string escapes)."""
    return json.dumps(text, ensure_ascii=False)
