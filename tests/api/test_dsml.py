"""DeepSeek output: ``<think>`` reasoning and DSML tool calls, cut anywhere, read as
deepseek-recipe's stream processor reads them."""

from __future__ import annotations

import json

import deepseek_recipe as recipe
import pytest

from api.output_parser import (
    THINK,
    ContentDelta,
    Delimiters,
    OutputParser,
    ParserConfig,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallStart,
    merge_deltas,
)
from shared import dsml

MODELS = {"DeepSeek-V4-Pro": "deepseek_v4", "DeepSeek-V4.1-Flash": "deepseek_v4.1"}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "now")
]


def _invoke(markup: dsml.Markup, name: str, parameters: list[tuple[str, bool, str]]) -> str:
    lines = [markup.invoke(name)]
    for key, string, value in parameters:
        lines.append(markup.parameter(key, string) + value + markup.parameter_close)
    lines.append(markup.invoke_close)
    return "\n".join(lines)


def _outputs(markup: dsml.Markup) -> list[str]:
    """Generated texts: reasoning, then an answer, calls or both."""
    open_, close = markup.block_delimiters
    weather = _invoke(
        markup,
        "get_weather",
        [
            ("city", True, 'Paris "rive gauche" é <b>'),
            ("days", False, "3"),
            ("options", False, '{"units": ["C", "F"], "hourly": true}'),
        ],
    )
    now = _invoke(markup, "now", [])
    block = f"{open_}\n{weather}\n{now}\n{close}"
    return [
        "Let me think.\nTwice.</think>\n\nThe answer is 42.",
        f"I need the weather.</think>\n\n{block}",
        f"Check first.</think>\n\nOne moment.\n\n{open_}\n{now}\n{close}",
        f"</think>{open_}\n{weather}\n{close}",
    ]


def _reference(model: str, text: str) -> tuple[str, str, list[tuple[str, str]]]:
    """Reasoning, content and calls as deepseek-recipe's Chat Completions stream has them."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    request = recipe.ChatCompletionRequest(body).convert(recipe.ConversionOptions())
    processor = recipe.StreamProcessor(
        recipe.ChatCompletionRequest.chunk_generator(request, "id", model),
        request.parsing_options,
    )
    chunks = processor.push(recipe.InferenceChunk.ready())
    chunks += processor.push(recipe.InferenceChunk.text(text, 1))
    chunks += processor.push(recipe.InferenceChunk.finish(recipe.InferenceFinishReason.Stop))
    chunks += processor.finish()
    reasoning, content, calls = "", "", []
    for chunk in chunks:
        for choice in json.loads(chunk.to_json())["choices"]:
            delta = choice["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                if "id" in call:
                    calls.append([call["function"]["name"], ""])
                calls[call["index"]][1] += call["function"].get("arguments", "")
    return reasoning, content, [tuple(call) for call in calls]


def _ours(markup: dsml.Markup, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    config = ParserConfig(
        reasoning=THINK,
        starts_in_reasoning=True,
        tool_calls=Delimiters(*markup.block_delimiters),
        dsml_tool_calls=True,
    )
    parser = OutputParser(config)
    deltas = [delta for piece in pieces for delta in parser.push(piece)] + parser.finish()
    reasoning = content = ""
    calls: list[list[str]] = []
    for delta in merge_deltas(deltas):
        match delta:
            case ReasoningDelta():
                reasoning += delta.text
            case ContentDelta():
                content += delta.text
            case ToolCallStart():
                calls.append([delta.name, ""])
            case ToolCallArgsDelta():
                calls[delta.index][1] += delta.text
    return reasoning, content, [tuple(call) for call in calls]


@pytest.mark.parametrize("model", list(MODELS))
def test_every_cut_reads_as_the_reference_stream_processor(model: str) -> None:
    markup = dsml.MARKUPS[MODELS[model]]
    for text in _outputs(markup):
        expected = _reference(model, text)
        assert _ours(markup, [text]) == expected, text
        for cut in range(1, len(text)):
            assert _ours(markup, [text[:cut], text[cut:]]) == expected, (text, cut)
        assert _ours(markup, list(text)) == expected, text


def test_the_arguments_are_json_typed_by_their_string_attribute() -> None:
    body = "\n" + _invoke(
        dsml.MARKUPS["deepseek_v4"],
        "f",
        [("s", True, "3"), ("n", False, "3"), ("b", False, "true")],
    )
    [(name, arguments)] = dsml.parse_calls(body + "\n")
    assert name == "f" and json.loads(arguments) == {"s": "3", "n": 3, "b": True}


def test_a_block_of_anything_but_invokes_is_content() -> None:
    markup = dsml.MARKUPS["deepseek_v4"]
    open_, close = markup.block_delimiters
    text = f"</think>{open_}\nnot a call\n{close} done"
    reasoning, content, calls = _ours(markup, [text])
    assert (reasoning, calls) == ("", []) and content == f"{open_}\nnot a call\n{close} done"
    assert dsml.parse_calls("\n") is None
