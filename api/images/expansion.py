"""An image's one placeholder token, expanded into the tokens the vision encoder fills.

The chat template writes one image token per image, a control token no user
text can produce. Each becomes the model's layout for that image (Idefics3:
a row of tiles after another, then the whole picture, each a run of image
tokens between markers), so ``prompt_tokens`` counts what the model reads
and ``max_tokens`` is resolved against it.
"""

from __future__ import annotations

import base64

from api.backends.base import ServedModel
from api.errors import ApiError
from api.images.resolution import ResolvedImage
from shared.images.idefics3 import IMAGE, Idefics3Processing, prompt_string
from shared.wire import WireImage


def expand_images(
    ids: list[int], images: list[ResolvedImage], model: ServedModel
) -> tuple[list[int], list[WireImage]]:
    """The prompt with each image token expanded, and each image with its span in it."""
    processing = model.image_processing
    assert processing is not None
    tokenizer = model.tokenizer
    image_id = tokenizer.special_tokens.get(IMAGE)
    at = [index for index, token in enumerate(ids) if token == image_id]
    if image_id is None or len(at) != len(images):
        raise ApiError(  # the model's template or tokenizer, not the client
            500,
            f"model {model.spec.name!r}: its prompt has {len(at)} {IMAGE} tokens for "
            f"{len(images)} images",
            "api_error",
        )
    expanded: list[int] = []
    wire: list[WireImage] = []
    previous = 0
    for position, image in zip(at, images, strict=True):
        expanded += ids[previous:position]
        start = len(expanded)
        expanded += _layout(image, processing, model)
        data = base64.b64encode(image.data).decode("ascii")
        wire.append(WireImage(data, image.digest.hex(), start, len(expanded)))
        previous = position + 1
    expanded += ids[previous:]
    return expanded, wire


def _layout(image: ResolvedImage, processing: Idefics3Processing, model: ServedModel) -> list[int]:
    """The image's tokens: server-written markup, so its control-token spellings are tokens."""
    rows, cols = processing.grid(*image.image.size)
    text = prompt_string(rows, cols, processing.image_seq_len)
    return model.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
