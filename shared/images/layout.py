"""An image's one placeholder token, expanded into the tokens the vision encoder fills.

The chat template (or an offline prompt) writes one placeholder per image, a
control token no user text can produce. Each becomes the model's layout for
that image (Idefics3: a row of tiles after another, then the whole picture,
each a run of image tokens between markers; DeepSeek V4.1: a run of image
tokens), so the prompt's length counts what the model reads, and each image
travels with the span it fills. The layout follows from the decoded picture's
size alone. Idefics3's is known from the image's header, before a pixel is
decoded; V4.1's only once the picture is fitted.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

from shared.images.decoding import DecodedImage
from shared.images.deepseek import EXPECTED_TOKENS, DeepseekImages
from shared.images.idefics3 import Idefics3Processing
from shared.tokenizer_loader import LoadedTokenizer
from shared.wire import WireImage

ImageProcessing = Idefics3Processing | DeepseekImages
"""How a model's pictures are decoded and laid out in its prompt."""


def expand_images(
    ids: list[int],
    images: Sequence[DecodedImage],
    processing: ImageProcessing,
    tokenizer: LoadedTokenizer,
) -> tuple[list[int], list[WireImage]]:
    """The prompt with each placeholder expanded, and each image with its span in it.

    ``ValueError`` when the prompt's placeholders and ``images`` differ in number.
    """
    placeholder = processing.placeholder
    image_id = tokenizer.special_tokens.get(placeholder)
    at = [index for index, token in enumerate(ids) if token == image_id]
    if image_id is None or len(at) != len(images):
        raise ValueError(f"the prompt has {len(at)} {placeholder} tokens for {len(images)} images")
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
    size: tuple[int, int], processing: ImageProcessing, tokenizer: LoadedTokenizer
) -> list[int]:
    """The ids a decoded picture of ``size`` (width, height) becomes in the prompt: its
    layout's markup."""
    return tokenizer.tokenizer.encode(processing.layout(size), add_special_tokens=False).ids


def image_tokens_reserved(
    size: tuple[int, int], processing: ImageProcessing, tokenizer: LoadedTokenizer
) -> int:
    """The tokens to hold for a picture stored at ``size`` before it is decoded.

    Idefics3: the most it takes in the prompt, whichever way up its EXIF
    orientation turns out to be (a PNG may carry it after its pixels). V4.1:
    the token budget pictures are fitted to; the exact count follows fitting.
    """
    if isinstance(processing, DeepseekImages):
        return EXPECTED_TOKENS
    width, height = size
    turned = {(width, height), (height, width)}
    return max(len(image_ids(each, processing, tokenizer)) for each in turned)
