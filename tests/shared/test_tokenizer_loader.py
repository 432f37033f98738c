"""Tokenizer loading from GGUF metadata and from tokenizer.json directories."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFWriter
from tokenizers import Tokenizer, processors

from shared.registry import smollm2_gguf_path
from shared.tokenizer_loader import LoadedTokenizer, load_tokenizer

CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x**2  # square\n\n\n",
    'if (a && b) { console.log("ok"); } else { throw new Error(`bad ${x}`); }',
    "héllo wörld, naïve café — «quotes» 日本語のテキスト 中文 한국어 Ελληνικά русский",
    "emoji 😀👍🏽🇫🇷👨‍👩‍👧 ok",
    "\t\ttabs\tand  spaces   between\u00a0words ",
    "3.14159 and 1,000,000 on 2024-01-01; 12345 items, v2.0.1",
    "I'm sure you'll see they've WE'RE it's",
    "$$\\frac{1}{2} + \\sum_{i=0}^{n} x_i$$",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>x<repo_name>y<file_sep><empty_output>",
    "<|im_start|",  # an incomplete spelling is plain text
    "  leading",
    "trailing  ",
    "",
    " ",
    "\n",
    "x\r\ny\r\n",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return smollm2_gguf_path()


@pytest.fixture(scope="module")
def loaded(gguf_path: Path) -> LoadedTokenizer:
    return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def reference(gguf_path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.mark.parametrize("text", CORPUS)
def test_encode_and_decode_match_transformers(loaded, reference, text):
    ours = loaded.tokenizer.encode(text, add_special_tokens=False).ids
    assert ours == reference.encode(text, add_special_tokens=False)
    decoded = loaded.tokenizer.decode(ours, skip_special_tokens=False)
    assert decoded == text
    assert decoded == reference.decode(ours, clean_up_tokenization_spaces=False)
    assert loaded.tokenizer.decode(ours, skip_special_tokens=True) == reference.decode(
        ours, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )


@pytest.mark.parametrize(
    ("text", "pieces"),
    [
        ("a  1", ["a", "ĠĠ", "1"]),
        ("x   23", ["x", "ĠĠĠ", "2", "3"]),
        ("n = 42", ["n", "Ġ=", "Ġ", "4", "2"]),
    ],
)
def test_digits_split_one_by_one_like_the_original_tokenizer(loaded, text, pieces):
    """SmolLM2's own tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) isolate each
    digit before the GPT-2 split. transformers' GGUF conversion skips that step, so a run
    of spaces before a digit comes out as "Ġ", "Ġ", "1" there; we follow the original."""
    ids = loaded.tokenizer.encode(text, add_special_tokens=False).ids
    assert [loaded.tokenizer.id_to_token(i) for i in ids] == pieces


def test_gguf_metadata(loaded):
    assert loaded.bos_token_id == 1
    assert loaded.eos_token_id == 2
    assert loaded.stop_token_ids == (2, 0)  # <|im_end|>, then <|endoftext|>
    assert loaded.add_bos_token is False
    assert loaded.chat_template is not None
    assert loaded.chat_template.startswith("{% for message in messages %}")
    assert len(loaded.special_tokens) == 17
    assert loaded.special_tokens["<|im_start|>"] == 1
    assert loaded.special_tokens["<empty_output>"] == 16


def test_control_tokens_are_whole_and_special(loaded):
    encoding = loaded.tokenizer.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)
    assert encoding.ids[0] == 1 and encoding.ids[-1] == 2
    assert loaded.tokenizer.decode(encoding.ids, skip_special_tokens=True) == "hi"
    # no BOS from the tokenizer itself: the caller decides
    assert loaded.tokenizer.encode("hi", add_special_tokens=True).ids == encoding.ids[1:-1]


def test_loads_are_cached_per_path(gguf_path, loaded):
    assert load_tokenizer(str(gguf_path)) is loaded


def test_shared_does_not_import_torch():
    code = "import sys, shared.tokenizer_loader, shared.registry; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2])
    assert result.returncode == 0


# --- hand-made GGUF tokenizers --------------------------------------------------


def _byte_alphabet() -> list[str]:
    """GPT-2's byte alphabet, spelled independently of the loader's copy."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]


def write_tokenizer_gguf(
    path: Path, tokens: list[str], types: list[int], merges: list[str], **extra
) -> Path:
    writer = GGUFWriter(str(path), "llama")
    writer.add_string("tokenizer.ggml.model", extra.pop("model", "gpt2"))
    writer.add_string("tokenizer.ggml.pre", extra.pop("pre", "gpt2"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, value in extra.items():
        if isinstance(value, bool):
            writer.add_bool(f"tokenizer.ggml.{key}", value)
        else:
            writer.add_uint32(f"tokenizer.ggml.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    alphabet = _byte_alphabet()
    tokens = [*alphabet, "he", "hel", "hell", "hello", "<s>", "<think>", "<｜end▁of▁turn｜>"]
    types = [1] * (len(alphabet) + 4) + [3, 4, 3]
    return tokens, types, ["h e", "he l", "hel l", "hell o"]


def test_user_defined_tokens_match_whole_but_are_not_special(tmp_path, tiny_vocab):
    tokens, types, merges = tiny_vocab
    path = write_tokenizer_gguf(tmp_path / "t.gguf", tokens, types, merges, bos_token_id=260)
    loaded = load_tokenizer(path)
    think, end = tokens.index("<think>"), tokens.index("<｜end▁of▁turn｜>")
    ids = loaded.tokenizer.encode("<think>hello<｜end▁of▁turn｜>").ids
    assert ids == [think, tokens.index("hello"), end]
    # <think> is text a reasoning parser must see; the control token is not
    assert loaded.tokenizer.decode(ids, skip_special_tokens=True) == "<think>hello"
    assert loaded.special_tokens == {"<s>": 260, "<think>": think, "<｜end▁of▁turn｜>": end}
    assert loaded.tokenizer.get_vocab_size() == len(tokens)
    assert loaded.add_bos_token is False


def test_llama3_pre_tokenizer_defaults_to_adding_bos(tmp_path, tiny_vocab):
    tokens, types, merges = tiny_vocab
    path = write_tokenizer_gguf(tmp_path / "l3.gguf", tokens, types, merges, pre="llama-bpe")
    loaded = load_tokenizer(path)
    assert loaded.add_bos_token is True
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("hello 123").ids) == "hello 123"


def test_unsupported_gguf_tokenizer_lists_supported(tmp_path, tiny_vocab):
    tokens, types, merges = tiny_vocab
    path = write_tokenizer_gguf(tmp_path / "spm.gguf", tokens, types, merges, model="llama")
    with pytest.raises(ValueError, match=r"'llama' is not supported; supported: gpt2"):
        load_tokenizer(path)


# --- tokenizer.json directories --------------------------------------------------


@pytest.fixture
def hf_dir(tmp_path, loaded) -> Path:
    loaded.tokenizer.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_tokenizer_json_dir(hf_dir, loaded):
    (hf_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": {"content": "<|im_end|>", "special": True},
                "add_bos_token": False,
                "chat_template": "{{ messages }}",
            }
        )
    )
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    tok = load_tokenizer(hf_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token) == (1, 2, False)
    assert tok.stop_token_ids == (2, 3, 0)
    assert tok.chat_template == "{{ messages }}"
    assert tok.special_tokens == loaded.special_tokens
    text = CORPUS[4]
    assert tok.tokenizer.encode(text).ids == loaded.tokenizer.encode(text).ids


def test_tokenizer_json_dir_infers_bos_from_post_processor(hf_dir, loaded):
    tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>"}))
    (hf_dir / "chat_template.jinja").write_text("standalone")
    tok = load_tokenizer(hf_dir)
    assert tok.add_bos_token is True
    assert tok.eos_token_id is None
    assert tok.stop_token_ids == (2, 0)  # end-of-turn spellings found in the vocabulary
    assert tok.chat_template == "standalone"


def test_named_chat_templates_pick_default(hf_dir):
    templates = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "chat"}]
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    assert load_tokenizer(hf_dir).chat_template == "chat"


def test_missing_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
