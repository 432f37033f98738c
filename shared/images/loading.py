"""A model's image processing, for the API and the engine alike.

A vision-language checkpoint is an HF directory: ``config.json`` names the
architecture and the encoder's geometry, the image processor's settings how
pictures become tiles: ``preprocessor_config.json``, or the
``image_processor`` table of ``processor_config.json`` as transformers 5
saves it. Both sides read the same files, so the API expands an
image into exactly as many tokens as the engine's encoder produces.

A DeepSeek V4.1 model's processing comes with its prompt format, not from its
checkpoint: the format writes ``<｜image｜>`` and the specification fits every
picture the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.images.deepseek import DeepseekImages
from shared.images.idefics3 import Idefics3Processing
from shared.images.layout import ImageProcessing
from shared.registry import ModelSpec

# Vision-language models: an encoder whose features stand in for a Llama text model's image
# tokens.
VISION_ARCHITECTURES = ("Idefics3ForConditionalGeneration",)


class InvalidImageProcessing(ValueError):
    """A vision checkpoint whose processing files are missing or unusable."""


def load_image_processing(weights: Path) -> Idefics3Processing | None:
    """The processing of the checkpoint at ``weights``; None for a text-only model."""
    config_path = weights / "config.json"
    if not weights.is_dir() or not config_path.is_file():
        return None  # a GGUF file: text-only
    config = json.loads(config_path.read_text())
    if (config.get("architectures") or [""])[0] not in VISION_ARCHITECTURES:
        return None
    try:
        vision = config["vision_config"]
        grid = vision["image_size"] // vision["patch_size"]
        image_seq_len = grid * grid // config["scale_factor"] ** 2
        return Idefics3Processing.from_hf(_image_processor(weights), image_seq_len)
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidImageProcessing(f"{weights}: unusable image processing ({exc})") from exc


def _image_processor(weights: Path) -> dict:
    """The image processor's settings, from either file transformers writes."""
    preprocessor = weights / "preprocessor_config.json"
    if preprocessor.is_file():
        return json.loads(preprocessor.read_text())
    processor = weights / "processor_config.json"
    if processor.is_file():
        settings = json.loads(processor.read_text()).get("image_processor")
        if isinstance(settings, dict):
            return settings
    raise InvalidImageProcessing(
        f"{weights} is a vision model without image processor settings "
        "(preprocessor_config.json, or processor_config.json with an image_processor)"
    )


def image_processing_for(spec: ModelSpec) -> ImageProcessing | None:
    """The model's image processing: it sees images exactly when it has one.

    A registry entry that declares ``images`` for a text-only checkpoint is
    refused here, at load, rather than dropping every image it is sent.
    """
    if spec.prompt_format == "deepseek_v4.1":
        return DeepseekImages()
    processing = load_image_processing(spec.weights)
    if processing is None and "images" in spec.capabilities:
        raise InvalidImageProcessing(
            f"model {spec.name!r} declares the 'images' capability, but {spec.weights} is not "
            f"a vision model (supported: {', '.join(VISION_ARCHITECTURES)})"
        )
    return processing
