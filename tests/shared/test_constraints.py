"""How grammars read JSON schemas: an object that names its properties is closed unless it
says otherwise, as pydantic, instructor and tool definitions mean it."""

from __future__ import annotations

from typing import Any

import llguidance
import pytest
from pydantic import BaseModel

from shared.constraints import (
    ToolSpec,
    closed_objects,
    grammar_of,
    lltokenizer,
    tool_call_grammar,
)
from shared.registry import smollm2_gguf_path
from shared.sampling import StructuredOutputs
from shared.tokenizer_loader import load_tokenizer


class Address(BaseModel):
    street: str
    tags: dict[str, str]  # free-form: pydantic writes additionalProperties for it


class Person(BaseModel):
    name: str
    home: Address
    past: list[Address]


@pytest.fixture(scope="module")
def tokenizer() -> llguidance.LLTokenizer:
    return lltokenizer(load_tokenizer(smollm2_gguf_path()))


def accepts(tokenizer: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


# Extra keys come last: llguidance keeps the named properties in the schema's order.
ADDRESS = '{"street": "Main", "tags": {"any": "key"}}'
PERSON = f'{{"name": "Ada", "home": {ADDRESS}, "past": [{ADDRESS}]}}'
EXTRA_TOP = PERSON[:-1] + ', "age": 3}'
EXTRA_NESTED = PERSON.replace('"key"}}', '"key"}, "zip": "1"}', 1)
EXTRA_IN_LIST = PERSON.replace(ADDRESS + "]", ADDRESS[:-1] + ', "zip": "1"}]')


def test_a_schema_that_leaves_additional_properties_out_keeps_to_named_keys(
    tokenizer: llguidance.LLTokenizer,
) -> None:
    grammar = grammar_of(StructuredOutputs(json=Person.model_json_schema()))
    assert accepts(tokenizer, grammar, PERSON)
    for text in (EXTRA_TOP, EXTRA_NESTED, EXTRA_IN_LIST):
        assert not accepts(tokenizer, grammar, text), text


def test_the_json_schema_reading_is_a_choice(tokenizer: llguidance.LLTokenizer) -> None:
    spec = StructuredOutputs(json=Person.model_json_schema())
    grammar = grammar_of(spec, additional_properties=True)
    for text in (PERSON, EXTRA_TOP, EXTRA_NESTED, EXTRA_IN_LIST):
        assert accepts(tokenizer, grammar, text), text


def test_what_a_schema_says_wins(tokenizer: llguidance.LLTokenizer) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}},
        "additionalProperties": {"type": "integer"},
    }
    grammar = grammar_of(StructuredOutputs(json=schema))
    assert accepts(tokenizer, grammar, '{"name": "Ada", "age": 3}')
    assert not accepts(tokenizer, grammar, '{"name": "Ada", "age": "3"}')


def test_json_object_mode_is_any_object(tokenizer: llguidance.LLTokenizer) -> None:
    grammar = grammar_of(StructuredOutputs(json_object=True))
    assert accepts(tokenizer, grammar, '{"whatever": [1, 2], "else": null}')


def test_forced_tool_arguments_keep_to_named_keys(tokenizer: llguidance.LLTokenizer) -> None:
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"%s}}\n</tool_call>'
    for open_objects in (False, True):
        grammar = tool_call_grammar(
            [ToolSpec("weather", parameters)],
            "hermes",
            parallel=False,
            additional_properties=open_objects,
        )
        assert accepts(tokenizer, grammar, call % "")
        assert accepts(tokenizer, grammar, call % ', "unit": "C"') is open_objects


def test_closed_objects_walks_every_subschema_and_only_schemas() -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            # a property named like a keyword is a name, not a schema of its own
            "properties": {"type": "object", "properties": {"a": {"type": "string"}}},
            "free": {"type": "object"},
            "choice": {"anyOf": [{"properties": {"b": {}}}, {"type": "null"}]},
        },
        "$defs": {"Thing": {"properties": {"c": {}}, "additionalProperties": True}},
        "items": {"properties": {"d": {}}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["properties"]["properties"]
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["free"]
    assert closed["properties"]["choice"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["Thing"]["additionalProperties"] is True
    assert closed["items"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the request's own schema is left as sent
