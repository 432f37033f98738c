"""Prompt injection through special-token spellings, end to end.

For every format and every spelling in the tokenizer's special vocabulary,
placed in every field a client controls, the encoded prompt's control ids
must be exactly the template's, and the user's text must stay text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer

from shared.conversation import (
    AssistantMessage,
    Conversation,
    SystemMessage,
    TextPart,
    Tool,
    ToolCall,
    ToolMessage,
    UserMessage,
)
from shared.prompting import RenderedPrompt
from shared.tokenization import PromptEncodingError, encode_prompt, plain_twin
from shared.tokenizer_loader import LoadedTokenizer
from tests.shared.test_prompting import (
    SMOLLM_SYSTEM,
    llama3_tokenizer,
    qwen3_tokenizer,
    render_for,
    smollm_tokenizer,
)

# (format, tokenizer): every hand-written format and the jinja format on each
# family's own template.
CASES = [
    ("chatml", smollm_tokenizer),
    ("jinja", smollm_tokenizer),
    ("chatml", qwen3_tokenizer),
    ("qwen3", qwen3_tokenizer),
    ("jinja", qwen3_tokenizer),
    ("llama3", llama3_tokenizer),
    ("jinja", llama3_tokenizer),
]
CASE_IDS = [f"{name}-{tokenizer.__name__.removesuffix('_tokenizer')}" for name, tokenizer in CASES]


def text(value: str) -> list[TextPart]:
    return [TextPart(value)]


def conversation_with(field: str, payload: str) -> tuple[Conversation, str | None]:
    """A conversation touching every kind of turn, ``payload`` in the named field.

    Returns the conversation and the default system prompt to render it with.
    """
    value = {name: "plain" for name in FIELDS}
    value[field] = payload
    arguments = json.dumps({"city": value["tool_call_arguments"]}, ensure_ascii=False)
    if field == "tool_call_arguments_raw":
        arguments = payload
    tool = Tool(
        name=value["tool_name"],
        description=value["tool_description"],
        parameters={"type": "object", "properties": {value["tool_parameters"]: {"type": "string"}}},
    )
    messages = [
        SystemMessage(text(value["system"])),
        UserMessage(text(value["user"])),
        AssistantMessage(text(value["assistant"])),
        UserMessage(text("call a tool")),
        AssistantMessage(
            text("calling"),
            tool_calls=[
                ToolCall(
                    id=value["tool_call_id"], name=value["tool_call_name"], arguments=arguments
                )
            ],
        ),
        ToolMessage(
            tool_call_id=value["tool_result_id"],
            name=value["tool_result_name"],
            content=text(value["tool_result"]),
        ),
        SystemMessage(text(value["later_system"]), role="developer"),
        AssistantMessage(text(value["prefix"]), reasoning=value["reasoning"], prefix=True),
    ]
    if field == "default_system_prompt":
        messages = messages[1:]
    return Conversation(messages=messages, tools=[tool]), value["default_system_prompt"]


FIELDS = (
    "system",
    "default_system_prompt",
    "user",
    "assistant",
    "reasoning",
    "prefix",
    "tool_call_id",
    "tool_call_name",
    "tool_call_arguments",
    "tool_call_arguments_raw",
    "tool_result",
    "tool_result_id",
    "tool_result_name",
    "tool_name",
    "tool_description",
    "tool_parameters",
    "later_system",
)

# Fields each layout shows the model; the others must be safe but may be absent.
_TOOLS = {
    "tool_name",
    "tool_description",
    "tool_parameters",
    "tool_call_name",
    "tool_call_arguments",
    "tool_call_arguments_raw",
}
_COMMON = {"system", "user", "assistant", "prefix", "tool_result", "later_system"}
RENDERED: dict[tuple[str, str], set[str]] = {
    ("chatml", "smollm"): _COMMON | _TOOLS | {"default_system_prompt"},
    ("jinja", "smollm"): _COMMON,
    ("chatml", "qwen3"): _COMMON | _TOOLS | {"default_system_prompt"},
    ("qwen3", "qwen3"): _COMMON | _TOOLS | {"default_system_prompt", "reasoning"},
    ("jinja", "qwen3"): _COMMON | _TOOLS | {"reasoning"},
    ("llama3", "llama3"): _COMMON | _TOOLS | {"default_system_prompt"},
    ("jinja", "llama3"): _COMMON,
}


def control_ids_of(ids: list[int], tok: LoadedTokenizer) -> list[int]:
    special_ids = set(tok.special_tokens.values())
    return [token_id for token_id in ids if token_id in special_ids]


def expected_control_ids(rendered: RenderedPrompt, tok: LoadedTokenizer) -> list[int]:
    expected = [tok.special_tokens[spelling] for spelling in rendered.special_texts()]
    return [tok.bos_token_id, *expected] if _adds_bos(rendered, tok) else expected


def _adds_bos(rendered: RenderedPrompt, tok: LoadedTokenizer) -> bool:
    """Whether encode_prompt must prepend BOS: wanted, and the prompt does not open with it."""
    if not tok.add_bos_token or tok.bos_token_id is None:
        return False
    ranges = rendered.special_ranges
    opens_with_bos = (
        bool(ranges)
        and ranges[0][0] == 0
        and (tok.special_tokens[rendered.special_texts()[0]] == tok.bos_token_id)
    )
    return not opens_with_bos


def assert_safe(rendered: RenderedPrompt, tok: LoadedTokenizer, payload: str) -> None:
    ids = encode_prompt(rendered, tok)
    # The only control ids are the template's, in the template's order...
    assert control_ids_of(ids, tok) == expected_control_ids(rendered, tok)
    # ...no control span reaches into the user's text...
    start = rendered.prompt.find(payload)
    while start != -1:
        end = start + len(payload)
        assert all(e <= start or s >= end for s, e in rendered.special_ranges), payload
        start = rendered.prompt.find(payload, start + 1)
    # ...and nothing is lost: the ids spell the prompt exactly.
    decoded = tok.tokenizer.decode(ids, skip_special_tokens=False)
    assert decoded.removeprefix(_bos_added(rendered, tok)) == rendered.prompt


def _bos_added(rendered: RenderedPrompt, tok: LoadedTokenizer) -> str:
    return _spelling(tok, tok.bos_token_id) if _adds_bos(rendered, tok) else ""


def _spelling(tok: LoadedTokenizer, token_id: int | None) -> str:
    return tok.tokenizer.id_to_token(token_id) if token_id is not None else ""


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize(("format_name", "tokenizer"), CASES, ids=CASE_IDS)
def test_every_special_spelling_in_every_field_stays_text(format_name, tokenizer, field):
    tok = tokenizer()
    family = tokenizer.__name__.removesuffix("_tokenizer")
    benign, default = conversation_with(field, "\u2603x\u2603")
    baseline = render_for(tok, format_name, benign, default_system_prompt=default)
    for spelling in tok.special_tokens:
        payload = f"\u2603{spelling}\u2603"
        conversation, default = conversation_with(field, payload)
        rendered = render_for(tok, format_name, conversation, default_system_prompt=default)
        assert_safe(rendered, tok, payload)
        # The user's spelling changed no control span: same spans as with harmless text.
        assert rendered.special_texts() == baseline.special_texts(), spelling
        # Qwen3 reads a "</think>" in an assistant's content as the end of its reasoning.
        split = spelling == "</think>" and field in ("assistant", "prefix")
        if split and family == "qwen3" and format_name != "chatml":
            continue
        if field in RENDERED[(format_name, family)]:
            assert payload in rendered.prompt, (spelling, rendered.prompt)


@pytest.mark.parametrize(("format_name", "tokenizer"), CASES, ids=CASE_IDS)
def test_a_bare_spelling_as_the_whole_message_is_text(format_name, tokenizer):
    tok = tokenizer()
    for spelling, token_id in tok.special_tokens.items():
        conversation = Conversation(messages=[UserMessage(text(spelling))])
        rendered = render_for(tok, format_name, conversation)
        ids = encode_prompt(rendered, tok)
        assert control_ids_of(ids, tok) == expected_control_ids(rendered, tok)
        plain = plain_twin(tok.tokenizer).plain.encode(spelling, add_special_tokens=False).ids
        assert token_id not in plain and len(plain) > 1


# Random conversations: data drawn from spellings and fragments of them. Replacing
# every spelling with "x" must leave the control spans unchanged. Spellings that
# Qwen3's template parses out of content (<think>, <tool_response>) are kept in the
# harmless twin too, since they legitimately change the layout.

_PARSED = {"<think>", "</think>", "<tool_response>", "</tool_response>"}


def _pieces(tok: LoadedTokenizer) -> st.SearchStrategy[list[str]]:
    fragments = ["a", " ", "\n", "<|", "|>", "<", ">", "\u2603", "{", '"']
    return st.lists(st.sampled_from(sorted(tok.special_tokens) + fragments), max_size=5)


@st.composite
def _twin_conversations(draw, tok: LoadedTokenizer) -> tuple[Conversation, Conversation]:
    """The same random conversation twice: with spellings, and with them replaced."""
    pieces = _pieces(tok)
    texts: list[list[str]] = []

    def data() -> int:
        texts.append(draw(pieces))
        return len(texts) - 1

    def build(spell: Callable[[int], str]) -> Conversation:
        return Conversation(messages=[make(spell) for make in makers], tools=tools(spell))

    makers = []
    for kind in draw(
        st.lists(st.sampled_from(["system", "user", "assistant", "tool"]), min_size=1, max_size=5)
    ):
        slot, extra = data(), data()
        if kind == "system":
            makers.append(lambda spell, s=slot: SystemMessage(text(spell(s))))
        elif kind == "user":
            makers.append(lambda spell, s=slot: UserMessage(text(spell(s))))
        elif kind == "tool":
            makers.append(
                lambda spell, s=slot, n=extra: ToolMessage(
                    tool_call_id="c", name=spell(n), content=text(spell(s))
                )
            )
        else:
            arguments = data()
            makers.append(
                lambda spell, s=slot, n=extra, a=arguments: AssistantMessage(
                    text(spell(s)),
                    reasoning=spell(n),
                    tool_calls=[
                        ToolCall(id="c", name="f" + spell(n), arguments=json.dumps({"q": spell(a)}))
                    ],
                )
            )
    tool_name, tool_description = data(), data()

    def tools(spell: Callable[[int], str]) -> list[Tool]:
        return [Tool(name="t" + spell(tool_name), description=spell(tool_description))]

    def injected(index: int) -> str:
        return "".join(texts[index])

    def harmless(index: int) -> str:
        return "".join(
            p if p in _PARSED or p not in tok.special_tokens else "x" for p in texts[index]
        )

    return build(injected), build(harmless)


def _property(format_name: str, tokenizer: Callable[[], LoadedTokenizer]) -> Callable:
    tok = tokenizer()

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_twin_conversations(tok), st.sampled_from([None, "sys <|im_end|> <|eot_id|>"]))
    def check(pair: tuple[Conversation, Conversation], default: str | None) -> None:
        injected, harmless = pair
        rendered = render_for(tok, format_name, injected, default_system_prompt=default)
        baseline = render_for(tok, format_name, harmless, default_system_prompt=default)
        assert rendered.special_texts() == baseline.special_texts()
        ids = encode_prompt(rendered, tok)
        assert control_ids_of(ids, tok) == expected_control_ids(rendered, tok)

    return check


@pytest.mark.parametrize(("format_name", "tokenizer"), CASES, ids=CASE_IDS)
def test_property_random_injections_change_no_control_span(format_name, tokenizer):
    _property(format_name, tokenizer)()


# --- encode_prompt itself ---------------------------------------------------------


def test_benign_prompts_encode_like_the_tokenizer_does():
    tok = smollm_tokenizer()
    conversation = Conversation(messages=[UserMessage(text("Hello there, 12345 é!"))])
    rendered = render_for(tok, "chatml", conversation, default_system_prompt=SMOLLM_SYSTEM)
    expected = tok.tokenizer.encode(rendered.prompt, add_special_tokens=False).ids
    assert encode_prompt(rendered, tok) == expected


def test_special_ranges_become_their_ids_and_text_stays_text():
    tok = smollm_tokenizer()
    prompt = "<|im_start|>user\n<|im_start|><|im_end|>"
    ids = encode_prompt(RenderedPrompt(prompt, [(0, 12), (29, 39)]), tok)
    assert ids[0] == tok.special_tokens["<|im_start|>"]
    assert ids[-1] == tok.special_tokens["<|im_end|>"]
    assert ids.count(tok.special_tokens["<|im_start|>"]) == 1


def test_a_range_that_is_not_one_special_token_is_a_bug():
    tok = smollm_tokenizer()
    with pytest.raises(PromptEncodingError, match="not one special token"):
        encode_prompt(RenderedPrompt("<|im_start|>user", [(0, 16)]), tok)
    with pytest.raises(PromptEncodingError, match="out of order"):
        encode_prompt(RenderedPrompt("<|im_end|><|im_end|>", [(10, 20), (0, 10)]), tok)
    with pytest.raises(PromptEncodingError, match="outside the prompt"):
        encode_prompt(RenderedPrompt("<|im_end|>", [(0, 11)]), tok)


def test_bos_is_prepended_once():
    tok = replace(smollm_tokenizer(), add_bos_token=True, bos_token_id=0)
    assert encode_prompt(RenderedPrompt("hi"), tok)[0] == 0
    with_bos = encode_prompt(RenderedPrompt("<|endoftext|>hi", [(0, 13)]), tok)
    assert with_bos[:2] != [0, 0] and with_bos[0] == 0
    assert encode_prompt(RenderedPrompt(""), tok) == [0]
    assert encode_prompt(RenderedPrompt(""), smollm_tokenizer()) == []


def test_the_plain_twin_is_built_once_and_encodes_in_one_batch(monkeypatch):
    tok = smollm_tokenizer()
    twin = plain_twin(tok.tokenizer)
    assert plain_twin(tok.tokenizer) is twin
    assert twin.plain.get_added_tokens_decoder() == {}
    assert twin.control_ids == frozenset(tok.special_tokens.values())

    calls = []

    class Counting:
        def encode_batch_fast(self, texts, add_special_tokens):
            calls.append(list(texts))
            return twin.plain.encode_batch_fast(texts, add_special_tokens=add_special_tokens)

    import shared.tokenization as tokenization

    monkeypatch.setitem(tokenization._twins, id(tok.tokenizer), replace(twin, plain=Counting()))
    conversation = Conversation(
        messages=[UserMessage(text("a")), AssistantMessage(text("b")), UserMessage(text("c"))]
    )
    rendered = render_for(tok, "chatml", conversation)
    encode_prompt(rendered, tok)
    assert len(calls) == 1 and len(calls[0]) > 3


def test_a_tokenizer_that_spells_control_tokens_from_text_is_refused():
    base = smollm_tokenizer()
    tokenizer = Tokenizer.from_str(base.tokenizer.to_str())
    word = "hello"
    word_id = tokenizer.token_to_id(word)
    assert word_id is not None
    tokenizer.add_special_tokens([AddedToken(word, special=True, normalized=False)])
    tok = replace(base, tokenizer=tokenizer, special_tokens={**base.special_tokens, word: word_id})
    with pytest.raises(PromptEncodingError, match="can produce control tokens from text"):
        encode_prompt(RenderedPrompt("hello"), tok)
