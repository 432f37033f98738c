"""Checkpoints as transformers and the hub save them: the processor's files under both
layouts, chat templates that read content as a list of parts, and generation_config.json's
sampling defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from api.backends.base import ServedModel
from api.preparation import PreparationContext, prepare
from api.protocols import chat_completions
from bench.vision_model import make_idefics3
from shared.conversation import (
    AssistantMessage,
    Conversation,
    ImagePart,
    ImageSource,
    SystemMessage,
    TextPart,
    UserMessage,
)
from shared.generation_config import SamplingDefaults, sampling_defaults
from shared.images.loading import load_image_processing
from shared.prompting import render
from shared.prompting.jinja import content_format
from shared.registry import ModelRegistry, ModelSpec
from shared.tokenizer_loader import load_tokenizer
from tests.engine.test_registry_models import make_tiny_model

# SmolVLM's published template: it reads every message's content as a list of parts.
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    return {
        layout: make_idefics3(root / layout, weights=False, layout=layout)
        for layout in ("transformers5", "legacy")
    }


def test_transformers5_saves_the_processor_in_its_own_files(layouts: dict[str, Path]) -> None:
    saved = {path.name for path in layouts["transformers5"].iterdir()}
    assert {"processor_config.json", "chat_template.jinja"} <= saved
    assert "preprocessor_config.json" not in saved
    config = json.loads((layouts["transformers5"] / "tokenizer_config.json").read_text())
    assert "chat_template" not in config


def test_both_layouts_give_the_same_processing_and_template(layouts: dict[str, Path]) -> None:
    new, legacy = layouts["transformers5"], layouts["legacy"]
    assert load_image_processing(new) == load_image_processing(legacy) is not None
    assert load_tokenizer(new).chat_template == load_tokenizer(legacy).chat_template
    assert load_tokenizer(new).eos_token_id == load_tokenizer(legacy).eos_token_id


def test_a_processor_saved_chat_template_json_is_read(tmp_path: Path) -> None:
    path = make_idefics3(tmp_path / "m", weights=False, layout="legacy")
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": SMOLVLM_TEMPLATE}))
    assert load_tokenizer(path).chat_template == SMOLVLM_TEMPLATE


def test_templates_that_loop_over_content_get_parts() -> None:
    assert content_format(SMOLVLM_TEMPLATE) == "openai"
    aliased = (
        "{% set turns = messages[1:] %}{% for m in turns %}"
        "{% for c in m.content | selectattr('type', 'equalto', 'text') %}{{ c.text }}"
        "{% endfor %}{% endfor %}"
    )
    assert content_format(aliased) == "openai"
    # Llama 3.1's kind: indexes into a list only when the content is not a string
    indexed = (
        "{% if messages[0]['content'] is string %}{{ messages[0]['content'] }}"
        "{% else %}{{ messages[0]['content'][0]['text'] }}{% endif %}"
        "{% for m in messages %}{{ m['content'] | trim }}{% endfor %}"
    )
    assert content_format(indexed) == "string"


CONVERSATIONS = {
    "text": Conversation(
        messages=[
            SystemMessage([TextPart("Be brief.")]),
            UserMessage([TextPart("Hello there")]),
            AssistantMessage([TextPart("Hi!")]),
            UserMessage([TextPart("What is 2+2?")]),
        ]
    ),
    "image": Conversation(
        messages=[
            UserMessage(
                [ImagePart(ImageSource(url="http://example.com/a.png")), TextPart("What is it?")]
            )
        ]
    ),
}


ROLES = {SystemMessage: "system", UserMessage: "user", AssistantMessage: "assistant"}


def hf_messages(conversation: Conversation) -> list[dict]:
    """The same conversation as transformers' processor takes it: content as typed parts."""
    return [
        {
            "role": ROLES[type(message)],
            "content": [
                {"type": "text", "text": part.text}
                if isinstance(part, TextPart)
                else {"type": "image"}
                for part in message.content
            ],
        }
        for message in conversation.messages
    ]


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_smolvlm_template_renders_what_transformers_renders(
    layouts: dict[str, Path], name: str
) -> None:
    path = layouts["transformers5"]
    tokenizer = load_tokenizer(path)
    processor = transformers.AutoProcessor.from_pretrained(path)
    conversation = CONVERSATIONS[name]
    expected = processor.apply_chat_template(
        hf_messages(conversation),
        chat_template=SMOLVLM_TEMPLATE,
        add_generation_prompt=True,
        tokenize=False,
    )
    ours = render(
        conversation,
        "jinja",
        special_tokens=tokenizer.special_tokens,
        chat_template=SMOLVLM_TEMPLATE,
    )
    assert ours.prompt == expected
    assert "Hello there" in expected or name == "image"


def test_the_content_format_can_be_forced(layouts: dict[str, Path]) -> None:
    tokenizer = load_tokenizer(layouts["transformers5"])
    conversation = CONVERSATIONS["text"]
    forced = render(
        conversation,
        "jinja",
        special_tokens=tokenizer.special_tokens,
        chat_template=SMOLVLM_TEMPLATE,
        content_format="string",
    )
    assert "Hello there" not in forced.prompt  # the template finds no parts in a string


GENERATION_CONFIG = {
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "max_new_tokens": 64,
    "do_sample": True,
    "eos_token_id": 2,
}


def test_generation_config_sampling_defaults(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    assert sampling_defaults(tmp_path) == SamplingDefaults(0.6, 0.95, 20, 0.05, 1.1, 64)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0, "top_k": "x"}))
    assert sampling_defaults(tmp_path) == SamplingDefaults()  # out of range: left out


@pytest.fixture(scope="module")
def tiny_context(tmp_path_factory: pytest.TempPathFactory) -> PreparationContext:
    path = make_tiny_model(tmp_path_factory.mktemp("generation") / "tiny")
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    spec = ModelSpec("tiny", path, prompt_format="chatml")
    served = ServedModel(spec, load_tokenizer(path), 512, None, sampling_defaults(path))
    return PreparationContext(ModelRegistry([spec]), {"tiny": served})


def test_a_request_gets_the_checkpoint_defaults_for_what_it_leaves_unset(
    tiny_context: PreparationContext,
) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    sampling = prepare(chat_completions.PROTOCOL, body, tiny_context).wire.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.6, 0.95, 20)
    assert (sampling.min_p, sampling.repetition_penalty, sampling.max_tokens) == (0.05, 1.1, 64)


def test_a_request_s_own_values_win(tiny_context: PreparationContext) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 3,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 10,
    }
    sampling = prepare(chat_completions.PROTOCOL, body, tiny_context).wire.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.0, 0.5, 3)
    assert (sampling.min_p, sampling.repetition_penalty, sampling.max_tokens) == (0.0, 1.0, 10)
