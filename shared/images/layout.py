"""An image's one placeholder token, expanded into the tokens the vision encoder fills.

The chat template (or an offline prompt) writes one image token per image, a
control token no user text can produce. Each becomes the model's layout for
that image (Idefics3: a row of tiles after another, then the whole picture,
each a run of image tokens between markers), so the prompt's length counts
what the model reads, and each image travels with the span it fills.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

from shared.images.decoding import DecodedImage
from shared.images.idefics3 import IMAGE, Idefics3Processing, prompt_string
from shared.tokenizer_loader import LoadedTokenizer
from shared.wire import WireImage


def expand_images(
    ids: list[int],
    images: Sequence[DecodedImage],
    processing: Idefics3Processing,
    tokenizer: LoadedTokenizer,
) -> tuple[list[int], list[WireImage]]:
    """The prompt with each image token expanded, and each image with its span in it.

    ``ValueError`` when the prompt's image tokens and ``images`` differ in number.
    """
    image_id = tokenizer.special_tokens.get(IMAGE)
    at = [index for index, token in enumerate(ids) if token == image_id]
    if image_id is None or len(at) != len(images):
        raise ValueError(f"the prompt has {len(at)} {IMAGE} tokens for {len(images)} images")
    expanded: list[int] = []
    wire: list[WireImage] = []
    previous = 0
    for position, image in zip(at, images, strict=True):
        expanded += ids[previous:position]
        start = len(expanded)
        text = prompt_string(*processing.grid(*image.image.size), processing.image_seq_len)
        expanded += tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
        data = base64.b64encode(image.data).decode("ascii")
        wire.append(WireImage(data, image.digest.hex(), start, len(expanded)))
        previous = position + 1
    expanded += ids[previous:]
    return expanded, wire
