"""Forced DSML tool calls: the grammar takes the calls as deepseek-recipe renders them,
typed by each tool's schema, and nothing else."""

from __future__ import annotations

import json

import deepseek_recipe as recipe
import llguidance
import pytest

from shared import dsml
from shared.constraints import ToolSpec, check, dsml_tool_call_grammar, lltokenizer
from shared.tokenizer_loader import load_tokenizer
from tests.deepseek_models import V4_TOKENIZER

WEATHER = ToolSpec(
    "get_weather",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "unit": {"type": "string", "enum": ["C", "F"]},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
        },
        "required": ["city"],
    },
)
CLOCK = ToolSpec("now", {"type": "object"})
ENCODINGS = {"deepseek_v4": recipe.DeepseekV4Encoding, "deepseek_v4.1": recipe.DeepseekV41Encoding}


@pytest.fixture(scope="module")
def tokenizer() -> llguidance.LLTokenizer:
    return lltokenizer(load_tokenizer(V4_TOKENIZER))


def _block(format_name: str, *calls: tuple[str, dict]) -> str:
    """The tool_calls block deepseek-recipe renders for an assistant turn making ``calls``."""
    turn = recipe.AssistantMessage(
        "",
        tool_calls=[recipe.ToolCall(f"c{i}", n, json.dumps(a)) for i, (n, a) in enumerate(calls)],
    )
    conversation = recipe.Conversation([recipe.UserMessage("hi"), turn], thinking_mode=False)
    prompt = ENCODINGS[format_name]().render_conversation(conversation).prompt
    open_, close = dsml.MARKUPS[format_name].block_delimiters
    return prompt[prompt.index(open_) : prompt.index(close) + len(close)]


def _accepts(tokenizer: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


@pytest.mark.parametrize("format_name", list(ENCODINGS))
def test_the_rendered_calls_are_what_the_grammar_takes(
    format_name: str, tokenizer: llguidance.LLTokenizer
) -> None:
    markup = dsml.MARKUPS[format_name]
    one = dsml_tool_call_grammar([WEATHER, CLOCK], markup, parallel=False, opened=False)
    many = dsml_tool_call_grammar([WEATHER, CLOCK], markup, parallel=True, opened=False)
    check(one, "tool_choice", tokenizer)
    full = {"city": "Paris <b>", "days": 3, "unit": "C", "where": {"lat": 48.9}}
    for arguments in (full, {"city": "Rome"}, {"city": "x", "unit": "F"}):
        assert _accepts(tokenizer, one, _block(format_name, ("get_weather", arguments)))
    assert _accepts(tokenizer, one, _block(format_name, ("now", {"any": [1], "thing": "x"})))
    two = _block(format_name, ("get_weather", {"city": "Oslo"}), ("now", {}))
    assert _accepts(tokenizer, many, two) and not _accepts(tokenizer, one, two)
    for wrong in (
        ("get_weather", {"days": 3}),  # the required city left out
        ("get_weather", {"city": "Rome", "days": "three"}),  # a string where JSON is typed
        ("get_weather", {"city": "Rome", "unit": "K"}),  # outside the enum
        ("get_weather", {"city": "Rome", "zip": "1"}),  # a property the schema does not name
        ("get_time", {}),  # no such tool
    ):
        assert not _accepts(tokenizer, many, _block(format_name, wrong)), wrong


def test_an_opened_block_continues_with_the_invokes(tokenizer: llguidance.LLTokenizer) -> None:
    markup = dsml.MARKUPS["deepseek_v4"]
    grammar = dsml_tool_call_grammar([WEATHER], markup, parallel=False, opened=True)
    block = _block("deepseek_v4", ("get_weather", {"city": "Lima"}))
    assert _accepts(tokenizer, grammar, block.removeprefix(markup.block_delimiters[0] + "\n"))
    assert not _accepts(tokenizer, grammar, block)
