"""An image's one placeholder token, expanded into the tokens the vision encoder fills.

The chat template (or an offline prompt) writes one image token per image, a
control token no user text can produce. Each becomes the model's layout for
that image (Idefics3: a row of tiles after another, then the whole picture,
each a run of image tokens between markers), so the prompt's length counts
what the model reads, and each image travels with the span it fills. The
layout follows from the picture's size alone, so its length is known from the
image's header, before a pixel is decoded.
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
        expanded += image_ids(image.size, processing, tokenizer)
        data = base64.b64encode(image.data).decode("ascii")
        wire.append(WireImage(data, image.digest.hex(), start, len(expanded)))
        previous = position + 1
    expanded += ids[previous:]
    return expanded, wire


def image_ids(
    size: tuple[int, int], processing: Idefics3Processing, tokenizer: LoadedTokenizer
) -> list[int]:
    """The ids a picture of ``size`` (width, height) becomes in the prompt: its layout's markup."""
    text = prompt_string(*processing.grid(*size), processing.image_seq_len)
    return tokenizer.tokenizer.encode(text, add_special_tokens=False).ids


def image_tokens_at_most(
    size: tuple[int, int], processing: Idefics3Processing, tokenizer: LoadedTokenizer
) -> int:
    """The most tokens a picture stored at ``size`` takes in the prompt, whichever way up its
    EXIF orientation turns out to be: a count from the header alone, before decoding reads
    the orientation (a PNG may carry it after its pixels)."""
    width, height = size
    turned = {(width, height), (height, width)}
    return max(len(image_ids(each, processing, tokenizer)) for each in turned)
