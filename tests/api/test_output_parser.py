"""OutputParser: exact deltas for representative outputs, and chunking invariance.

The property that matters to every protocol: however the engine cuts the text,
the merged deltas are the same as for the text in one piece.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.output_parser import (
    HERMES_TOOL_CALL,
    THINK,
    ContentDelta,
    Delimiters,
    Delta,
    OutputParser,
    ParserConfig,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallsDone,
    ToolCallStart,
    merge_deltas,
    new_tool_call_id,
)

FULL = ParserConfig(reasoning=THINK, tool_calls=HERMES_TOOL_CALL)
PLAIN = ParserConfig()
LLAMA = ParserConfig(bare_json_tool_calls=True)


def counting_ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parse(config: ParserConfig, chunks: list[str]) -> list[Delta]:
    """Raw deltas of one run, ids numbered from call_0."""
    parser = OutputParser(config, id_factory=counting_ids())
    deltas: list[Delta] = []
    for chunk in chunks:
        deltas += parser.push(chunk)
    return deltas + parser.finish()


def merged(config: ParserConfig, chunks: list[str]) -> list[Delta]:
    return merge_deltas(parse(config, chunks))


def call(index: int, name: str, arguments: str) -> list[Delta]:
    return [
        ToolCallStart(index, f"call_{index}", name),
        ToolCallArgsDelta(index, arguments),
        ToolCallEnd(index),
    ]


@dataclass(slots=True)
class Case:
    name: str
    config: ParserConfig
    text: str
    expected: list[Delta]


NESTED_ARGS = (
    '{"query": "a}b{c", "quote": "say \\"hi\\" \\\\", "path": "C:\\\\", '
    '"deep": {"list": [1, [2, {"x": "]"}]], "emoji": "héllo ☃ 😀"}, "empty": {}}'
)

CASES = [
    Case(
        "plain",
        PLAIN,
        "Hello, <think> and <tool_call> are text.",
        [ContentDelta("Hello, <think> and <tool_call> are text.")],
    ),
    Case(
        "near misses",
        FULL,
        "a <thin b <tool_callx c </think> d </tool_call> e <",
        [ContentDelta("a <thin b <tool_callx c </think> d </tool_call> e <")],
    ),
    Case(
        "reasoning then content",
        FULL,
        "<think>\nLet me see.\n</think>\n\nThe answer.",
        [
            ReasoningDelta("\nLet me see.\n"),
            ContentDelta("The answer."),
        ],
    ),
    Case(
        "starts in reasoning",
        ParserConfig(reasoning=THINK, starts_in_reasoning=True),
        "thinking <think> still\n</think>\n answer </think>",
        [ReasoningDelta("thinking <think> still\n"), ContentDelta("answer </think>")],
    ),
    Case(
        "reasoning never closed",
        ParserConfig(reasoning=THINK, starts_in_reasoning=True),
        "cut short </thi",
        [ReasoningDelta("cut short </thi")],
    ),
    Case(
        "one call with nested json",
        FULL,
        f'Checking.\n<tool_call>\n{{"name": "search", "arguments": {NESTED_ARGS}}}\n</tool_call>',
        [ContentDelta("Checking.\n"), *call(0, "search", NESTED_ARGS)],
    ),
    Case(
        "reasoning, several calls, content after",
        FULL,
        '<think>plan</think>\n\n<tool_call>\n{"name": "a", "arguments": {"n": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b\\u00e9", "arguments": {"s": "</tool_call>"}}\n</tool_call>\n'
        "  Done.",
        [
            ReasoningDelta("plan"),
            *call(0, "a", '{"n": 1}'),
            *call(1, "bé", '{"s": "</tool_call>"}'),
            ContentDelta("Done."),
        ],
    ),
    Case(
        "tool markup inside reasoning is reasoning",
        FULL,
        '<think><tool_call>{"name": "x"}</tool_call></think>ok',
        [ReasoningDelta('<tool_call>{"name": "x"}</tool_call>'), ContentDelta("ok")],
    ),
    Case(
        "features off: delimiters are content",
        ParserConfig(),
        '<think>x</think><tool_call>{"name": "f", "arguments": {}}</tool_call> END tail',
        [
            ContentDelta(
                '<think>x</think><tool_call>{"name": "f", "arguments": {}}</tool_call> END tail'
            ),
        ],
    ),
    Case(
        "other key order is parsed whole",
        FULL,
        '<tool_call>{"arguments": {"a": [1]}, "name": "f"}</tool_call>',
        call(0, "f", '{"a": [1]}'),
    ),
    Case(
        "parameters key streams too",
        FULL,
        '<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>',
        call(0, "f", '{"a": 1}'),
    ),
    Case(
        "string arguments pass as they are",
        FULL,
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        call(0, "f", '{"a": 1}'),
    ),
    Case(
        "not a call: markup is content",
        FULL,
        "see <tool_call>not json</tool_call> ok",
        [ContentDelta("see <tool_call>not json</tool_call> ok")],
    ),
    Case(
        "streamed call cut short is closed",
        FULL,
        '<tool_call>{"name": "f", "arguments": {"a": "unfinished',
        [
            ToolCallStart(0, "call_0", "f"),
            ToolCallArgsDelta(0, '{"a": "unfinished'),
            ToolCallEnd(0),
        ],
    ),
    Case(
        "call without closing delimiter",
        FULL,
        '<tool_call>{"name": "f", "arguments": {}}\n',
        call(0, "f", "{}"),
    ),
    Case(
        "held body without closing delimiter is parsed at the end",
        FULL,
        '<tool_call>{"arguments": {}, "name": "f"}',
        call(0, "f", "{}"),
    ),
    Case(
        "truncated before the arguments becomes content",
        FULL,
        '<tool_call>\n{"name": "f", "argu',
        [ContentDelta('<tool_call>\n{"name": "f", "argu')],
    ),
    Case(
        "bare json call",
        LLAMA,
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        call(0, "get_weather", '{"city": "Paris"}'),
    ),
    Case(
        "python tag, nested json, several bare calls",
        LLAMA,
        f'\n<|python_tag|>{{"name": "a", "arguments": {NESTED_ARGS}}}; '
        '{"parameters": {"s": "; {"}, "name": "b"};{"name": "c", "parameters": {}}\n',
        [*call(0, "a", NESTED_ARGS), *call(1, "b", '{"s": "; {"}'), *call(2, "c", "{}")],
    ),
    Case(
        "bare calls separated by whitespace only",
        LLAMA,
        '{"name": "a", "parameters": {}}\n\n{"name": "b", "parameters": {}}',
        [*call(0, "a", "{}"), *call(1, "b", "{}")],
    ),
    Case(
        "bare call after reasoning",
        ParserConfig(reasoning=THINK, bare_json_tool_calls=True),
        '<think>use {"name": "f"}</think>\n\n{"name": "f", "parameters": {"n": 1}}',
        [ReasoningDelta('use {"name": "f"}'), *call(0, "f", '{"n": 1}')],
    ),
    Case(
        "plain answer with bare calls on",
        LLAMA,
        '  The set is {1, 2}; {"name": "f", "parameters": {}}',
        [ContentDelta('The set is {1, 2}; {"name": "f", "parameters": {}}')],
    ),
    Case(
        "json that is not a call is content, and so is what follows",
        LLAMA,
        '<|python_tag|>{"name": "Bob"}; {"name": "f", "parameters": {}}',
        [ContentDelta('<|python_tag|>{"name": "Bob"}; {"name": "f", "parameters": {}}')],
    ),
    Case(
        "text after a bare call is content",
        LLAMA,
        '{"name": "f", "parameters": {}} \n; done {"name": "g", "parameters": {}}',
        [*call(0, "f", "{}"), ContentDelta('; done {"name": "g", "parameters": {}}')],
    ),
    Case(
        "near-miss leads are content",
        LLAMA,
        '<|python_tag|> {"name": "f", "parameters": {}}',
        [ContentDelta('<|python_tag|> {"name": "f", "parameters": {}}')],
    ),
    Case(
        "bare call cut short is content",
        LLAMA,
        '<|python_tag|>{"name": "f", "parameters": {"a": "}',
        [ContentDelta('<|python_tag|>{"name": "f", "parameters": {"a": "}')],
    ),
    Case(
        "text after bare calls ends them",
        ParserConfig(bare_json_tool_calls=True),
        '{"name": "f", "parameters": {"q": "END; "}} END',
        [*call(0, "f", '{"q": "END; "}'), ContentDelta("END")],
    ),
    Case(
        "bare calls beside hermes markup",
        ParserConfig(tool_calls=HERMES_TOOL_CALL, bare_json_tool_calls=True),
        '{"name": "a", "parameters": {}}\n<tool_call>{"name": "b", "arguments": {}}</tool_call>',
        [*call(0, "a", "{}"), *call(1, "b", "{}")],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_exact_deltas(case: Case) -> None:
    assert merged(case.config, [case.text]) == case.expected


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_every_single_split_point(case: Case) -> None:
    for cut in range(len(case.text) + 1):
        chunks = [case.text[:cut], case.text[cut:]]
        assert merged(case.config, chunks) == case.expected, f"cut at {cut}"


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_one_character_chunks(case: Case) -> None:
    assert merged(case.config, list(case.text)) == case.expected


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=16))
def test_multi_way_splits(case: Case, cuts: list[int]) -> None:
    assert merged(case.config, split(case.text, cuts)) == case.expected


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({cut % (len(text) + 1) for cut in cuts})
    bounds = [0, *points, len(text)]
    return [text[start:end] for start, end in itertools.pairwise(bounds)]


# Fragments that collide in every way: delimiters, their near misses, JSON
# punctuation, escapes and plain text overlapping the markup.
DELIMITERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
NEAR_MISSES = ["<thin", "</thi", "<tool_callx", "<tool", "<"]
JSON_BODIES = ['{"name": "f", "arguments": ', '{"arguments": {}, "name": "g"}']
JSON_PUNCTUATION = ["{", "}", "[", "]", '"', '\\"', "\\\\", ", ", ": "]
TEXT = ["\n", " ", "x", "é", "ST", "OP"]
FRAGMENTS = DELIMITERS + NEAR_MISSES + JSON_BODIES + JSON_PUNCTUATION + TEXT
fuzz_texts = st.lists(st.sampled_from(FRAGMENTS), max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(
    text=fuzz_texts,
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=10),
)
def test_fuzzed_text_is_chunking_invariant(text: str, cuts: list[int]) -> None:
    config = ParserConfig(reasoning=THINK, tool_calls=HERMES_TOOL_CALL)
    whole = merged(config, [text])
    assert merged(config, split(text, cuts)) == whole
    assert merged(config, list(text)) == whole
    assert_well_formed(whole)


BARE_FRAGMENTS = [
    "<|python_tag|>",
    "<|python",
    "_tag|>",
    "; ",
    ";",
    '{"name": "f", "parameters": ',
    '{"parameters": {}, "name": "g"}',
    '{"name": "h"}',
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    *JSON_PUNCTUATION,
    *TEXT,
]
bare_fuzz_texts = st.lists(st.sampled_from(BARE_FRAGMENTS), max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(
    text=bare_fuzz_texts,
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=10),
    hermes=st.booleans(),
    single=st.booleans(),
)
def test_fuzzed_bare_json_calls_are_chunking_invariant(
    text: str, cuts: list[int], hermes: bool, single: bool
) -> None:
    config = ParserConfig(
        reasoning=THINK,
        tool_calls=HERMES_TOOL_CALL if hermes else None,
        bare_json_tool_calls=True,
        single_tool_call=single,
    )
    whole = merged(config, [text])
    assert merged(config, split(text, cuts)) == whole
    assert merged(config, list(text)) == whole
    assert_well_formed(whole)


def assert_well_formed(deltas: list[Delta]) -> None:
    """Calls open, stream and close in order with indices 0, 1, ...; a done is last."""
    open_index, next_index = None, 0
    for position, delta in enumerate(deltas):
        if isinstance(delta, ToolCallStart):
            assert open_index is None and delta.index == next_index
            open_index, next_index = delta.index, next_index + 1
        elif isinstance(delta, ToolCallArgsDelta):
            assert delta.index == open_index
        elif isinstance(delta, ToolCallEnd):
            assert delta.index == open_index
            open_index = None
        elif isinstance(delta, ToolCallsDone):
            assert position == len(deltas) - 1
        else:
            assert open_index is None
    assert open_index is None


def test_holds_back_only_a_possible_delimiter() -> None:
    parser = OutputParser(FULL)
    assert parser.push("Hello <") == [ContentDelta("Hello ")]
    assert parser.push("b>") == [ContentDelta("<b>")]
    assert parser.push("x </th") == [ContentDelta("x </th")]  # closing tag is not live in content
    assert parser.push("<tool_ca") == []
    assert parser.finish() == [ContentDelta("<tool_ca")]


def test_held_back_tail_never_exceeds_the_longest_marker() -> None:
    parser = OutputParser(ParserConfig(reasoning=THINK, tool_calls=HERMES_TOOL_CALL))
    longest = len("<tool_call>")
    pushed = emitted = 0
    for chunk in ["<", "to", "ol", "<tool_ca", "ll", "<thin", "k", "<", "/", "x"] * 3:
        pushed += len(chunk)
        emitted += sum(len(delta.text) for delta in parser.push(chunk))
        assert pushed - emitted <= longest - 1


def test_held_back_tail_before_a_bare_call_never_exceeds_the_longest_lead() -> None:
    parser = OutputParser(ParserConfig(bare_json_tool_calls=True))
    longest = len("<|python_tag|>{")
    pushed = emitted = 0
    for chunk in ["<|py", "thon_", "tag|>", " ", "EN", "x", "<|python_tag|", "x", "\n"] * 3:
        pushed += len(chunk)
        emitted += sum(len(delta.text) for delta in parser.push(chunk))
        assert pushed - emitted <= longest - 1


def test_a_bare_call_is_held_until_its_object_ends() -> None:
    parser = OutputParser(LLAMA, id_factory=counting_ids())
    assert parser.push("<|python_tag|>") == []
    assert parser.push('{"name": "f", "parameters": {"city": "Par') == []
    assert parser.push('is"}}') == call(0, "f", '{"city": "Paris"}')
    assert parser.push(";") == []
    assert parser.finish() == [ContentDelta(";")]


def test_arguments_stream_before_the_call_ends() -> None:
    parser = OutputParser(FULL, id_factory=lambda: "call_x")
    assert parser.push('<tool_call>\n{"name": "get_weather", "argum') == []
    assert parser.push('ents": {"city": "Par') == [
        ToolCallStart(0, "call_x", "get_weather"),
        ToolCallArgsDelta(0, '{"city": "Par'),
    ]
    assert parser.push('is"}}') == [ToolCallArgsDelta(0, 'is"}')]
    assert parser.push("\n</tool_call>") == [ToolCallEnd(0)]
    assert parser.finish() == []


def test_escape_split_across_chunks() -> None:
    chunks = ['<tool_call>{"name": "f", "arguments": {"a": "\\', '"}"}}</tool_call>']
    assert merged(FULL, chunks) == call(0, "f", '{"a": "\\"}"}')


def test_merge_deltas_joins_same_kind_and_index_only() -> None:
    deltas: list[Delta] = [
        ContentDelta("a"),
        ContentDelta(""),
        ContentDelta("b"),
        ReasoningDelta("c"),
        ToolCallArgsDelta(0, "{"),
        ToolCallArgsDelta(0, "}"),
        ToolCallArgsDelta(1, "{"),
        ToolCallEnd(1),
        ToolCallEnd(1),
    ]
    assert merge_deltas(deltas) == [
        ContentDelta("ab"),
        ReasoningDelta("c"),
        ToolCallArgsDelta(0, "{}"),
        ToolCallArgsDelta(1, "{"),
        ToolCallEnd(1),
        ToolCallEnd(1),
    ]


def test_tool_call_ids_look_like_openai_ids() -> None:
    ids = {new_tool_call_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", call_id) for call_id in ids)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"starts_in_reasoning": True},
        {"reasoning": Delimiters("<x>", "<x>")},
        {"tool_calls": Delimiters("", "</x>")},
    ],
)
def test_config_rejects_unusable_settings(kwargs) -> None:
    with pytest.raises(ValueError):
        ParserConfig(**kwargs)


TWO_CALLS = (
    'Let me check.<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
    '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
)


@pytest.mark.parametrize("cut", [1, 7, 20, 40, len(TWO_CALLS)])
def test_a_single_tool_call_request_stops_after_its_first_call(cut: int) -> None:
    config = ParserConfig(tool_calls=HERMES_TOOL_CALL, single_tool_call=True)

    deltas = merged(config, [TWO_CALLS[:cut], TWO_CALLS[cut:]])

    assert deltas == [ContentDelta("Let me check."), *call(0, "a", '{"x": 1}'), ToolCallsDone()]


def test_a_single_tool_call_request_stops_after_a_held_body_too() -> None:
    config = ParserConfig(tool_calls=HERMES_TOOL_CALL, single_tool_call=True)
    text = '<tool_call>{"arguments": {}, "name": "a"}</tool_call><tool_call>{"name": "b"}'

    assert merged(config, [text]) == [*call(0, "a", "{}"), ToolCallsDone()]


BARE_TWO_CALLS = (
    '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
)


@pytest.mark.parametrize("cut", [1, 14, 20, 40, 50, len(BARE_TWO_CALLS)])
def test_a_single_tool_call_request_stops_after_its_first_bare_call(cut: int) -> None:
    config = ParserConfig(bare_json_tool_calls=True, single_tool_call=True)

    deltas = merged(config, [BARE_TWO_CALLS[:cut], BARE_TWO_CALLS[cut:]])

    assert deltas == [*call(0, "a", '{"x": 1}'), ToolCallsDone()]


def test_parallel_tool_calls_are_all_parsed_by_default() -> None:
    deltas = merged(ParserConfig(tool_calls=HERMES_TOOL_CALL), [TWO_CALLS])

    assert [d.name for d in deltas if isinstance(d, ToolCallStart)] == ["a", "b"]
    assert ToolCallsDone() not in deltas
