"""The grammars the API compiles, as the one Lark text vLLM's guidance backend reads: each
accepts exactly what the grammar it came from accepts."""

from __future__ import annotations

import llguidance
import pytest

from shared import dsml
from shared.constraints import (
    ToolSpec,
    after_reasoning,
    dsml_tool_call_grammar,
    grammar_of,
    lltokenizer,
    tool_call_grammar,
)
from shared.registry import smollm2_gguf_path
from shared.sampling import StructuredOutputs
from shared.tokenizer_loader import load_tokenizer
from workers.vllm_engine import lark_of

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [ToolSpec("forecast", SCHEMA), ToolSpec("time", {"type": "object"})]
MARKUP = dsml.MARKUPS["deepseek_v4"]
OPEN, CLOSE = MARKUP.block_delimiters
DSML_CALL = (
    f"{OPEN}\n{MARKUP.invoke('forecast')}\n{MARKUP.parameter('city', string=True)}Oslo"
    f"{MARKUP.parameter_close}\n{MARKUP.invoke_close}\n{CLOSE}"
)
CASES = {
    "json": (
        grammar_of(StructuredOutputs(json=SCHEMA)),
        ['{"city": "Oslo", "days": 2}', '{"city": "Oslo"}'],
        ['{"city": 3}', '{"days": 2}', '{"city": "Oslo", "x": 1}'],
    ),
    "regex": (grammar_of(StructuredOutputs(regex="[0-9]{3}")), ["123"], ["12", "1234"]),
    "choice": (grammar_of(StructuredOutputs(choice=["yes", "no"])), ["yes", "no"], ["maybe"]),
    "hermes": (
        tool_call_grammar(TOOLS, "hermes", parallel=True),
        [
            '<tool_call>\n{"name": "forecast", "arguments": {"city": "Oslo"}}\n</tool_call>',
            '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>',
        ],
        ['<tool_call>\n{"name": "forecast", "arguments": {}}\n</tool_call>'],
    ),
    "thinking json": (
        after_reasoning(grammar_of(StructuredOutputs(json=SCHEMA)), "</think>"),
        ['Paris? No.</think>\n\n{"city": "Oslo"}', '</think>{"city": "Oslo"}'],
        ['{"city": "Oslo"}', 'x</think>\n\n{"days": 1}'],
    ),
    "thinking dsml": (
        after_reasoning(
            dsml_tool_call_grammar(TOOLS, MARKUP, parallel=False, opened=False), "</think>"
        ),
        [f"Oslo, then.</think>\n\n{DSML_CALL}"],
        ['</think>\n\n{"city": "Oslo"}', DSML_CALL],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_lark_text_accepts_what_the_grammar_accepts(case: str) -> None:
    grammar, accepted, refused = CASES[case]
    lark = llguidance.LLMatcher.grammar_from_lark(lark_of(grammar))
    assert llguidance.LLMatcher.validate_grammar(lark) == ""
    tokenizer = lltokenizer(load_tokenizer(smollm2_gguf_path()))
    for text in accepted + refused:
        verdicts = []
        for each in (grammar, lark):
            matcher = llguidance.LLMatcher(tokenizer, each)
            verdicts.append(
                matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()
            )
        assert verdicts == [text in accepted] * 2, (case, text)
