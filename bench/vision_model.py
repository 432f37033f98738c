"""Random-weight Idefics3 (SmolVLM) checkpoints of the real architecture, saved as HF directories.

No vision model's weights are on this machine, so tests and benchmarks build
one with transformers' own ``Idefics3ForConditionalGeneration`` and save it
like any checkpoint: ``config.json``, ``model.safetensors``, and the default
model's tokenizer with SmolVLM's image tokens and chat template added, with
the processor saved as transformers 5 saves it (``processor_config.json``
holding the image processor, ``chat_template.jinja``) or, with
``layout="legacy"``, as older releases did (``preprocessor_config.json``,
the template in ``tokenizer_config.json``). ``tiny`` keeps tests fast;
``smolvlm-256m`` has SmolVLM-256M's shapes, for timing the encoder.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

from tokenizers import AddedToken, Tokenizer

from shared.registry import default_registry
from shared.tokenizer_loader import load_tokenizer

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
IMAGE_TOKENS += [f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)]

# SmolVLM's template, taking string content as well as typed parts.
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}: {{ message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}<image>{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {
        "text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
        "text_heads": (4, 2),
        "vision": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "patch_size": 8,
            "image_size": 32,
        },
        "scale_factor": 2,
        "longest_edge": 128,
    },
    "smolvlm-256m": {
        "text": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30},
        "text_heads": (9, 3),
        "vision": {
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "patch_size": 16,
            "image_size": 512,
        },
        "scale_factor": 4,
        "longest_edge": 2048,
    },
}


Layout = Literal["transformers5", "legacy"]


def make_idefics3(
    path: Path,
    shape: str = "tiny",
    seed: int = 0,
    weights: bool = True,
    layout: Layout = "transformers5",
) -> Path:
    """Save a random-weight Idefics3 of ``shape`` at ``path``; returns ``path``.

    Without ``weights`` only the files the API reads are written (config,
    tokenizer, preprocessing): enough to prepare requests, in a second.
    """
    import transformers

    if layout == "transformers5":  # the model's files as they are, the processor re-saved
        with tempfile.TemporaryDirectory() as legacy:
            make_idefics3(Path(legacy), shape, seed, weights, layout="legacy")
            processor = transformers.AutoProcessor.from_pretrained(legacy)
            processor.chat_template = CHAT_TEMPLATE
            processor.save_pretrained(path)
            for model_file in Path(legacy).iterdir():
                if model_file.name == "config.json" or model_file.suffix == ".safetensors":
                    shutil.copy(model_file, path / model_file.name)
        return path

    sizes = SHAPES[shape]
    path.mkdir(parents=True, exist_ok=True)
    shared = load_tokenizer(default_registry().resolve("default").weights).tokenizer
    tokenizer = Tokenizer.from_str(shared.to_str())  # a copy: the loaded one is cached
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in IMAGE_TOKENS]
    )
    heads, kv_heads = sizes["text_heads"]
    config = transformers.Idefics3Config(
        text_config={
            "model_type": "llama",
            "vocab_size": tokenizer.get_vocab_size(),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_theta": 100000.0,
            **sizes["text"],
        },
        vision_config=sizes["vision"],
        scale_factor=sizes["scale_factor"],
        image_token_id=tokenizer.token_to_id("<image>"),
        tie_word_embeddings=True,
    )
    if weights:
        _save_weights(config, path, seed)
    else:
        config.architectures = ["Idefics3ForConditionalGeneration"]
        config.save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<end_of_utterance>", "chat_template": CHAT_TEMPLATE})
    )
    image_size = sizes["vision"]["image_size"]
    (path / "preprocessor_config.json").write_text(json.dumps(_preprocessor(image_size, sizes)))
    return path


def vision_model_options(directory: Path, name: str = "seer") -> list[str]:
    """``sluice serve``'s options for a random-weight Idefics3 named ``name``: the checkpoint
    made under ``directory``, and a registry entry that declares its images."""
    weights = make_idefics3(directory / "weights")
    config = directory / "models.toml"
    config.write_text(f'[models.{name}]\nweights = "{weights}"\ncapabilities = ["images"]\n')
    return ["--config", str(config), "--model", name]


def _save_weights(config: Any, path: Path, seed: int) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(config)
    with torch.no_grad():  # outputs that depend on the image: HF's init makes logits flat
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif param.dim() > 1:
                param.normal_(0, param.shape[-1] ** -0.5)
    model.save_pretrained(path, safe_serialization=True)


def _preprocessor(image_size: int, sizes: dict[str, Any]) -> dict[str, Any]:
    """SmolVLM's preprocessing: tiles of the encoder's size, the picture at most 4 tiles wide."""
    return {
        "image_processor_type": "Idefics3ImageProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"longest_edge": sizes["longest_edge"]},
        "resample": 1,
        "do_image_splitting": True,
        "max_image_size": {"longest_edge": image_size},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pad": True,
    }
