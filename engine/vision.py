"""A sequence's images in the engine: decoded at admission, encoded when first needed.

The prompt holds each image as a span of placeholder tokens (``WireImage``);
the image token's positions inside the spans, in order, are where the vision
encoder's features go. Features are computed for all of a sequence's images
at once, the first time a chunk reaches one of those positions; a prompt
whose images were all served from the prefix cache never runs the encoder.

A decoded picture is kept until then, not its tiles: a 1024x1024 photo is
3 MB as pixels and 53 MB as SmolVLM's float32 tiles, so a queue of waiting
image requests holds the former, and tiles exist only while they are encoded.
It is kept as preprocessing first resizes it (``Idefics3Processing.shrink``),
which gives the same tiles: a 7000x7000 scan waits as SmolVLM-256M's
2048x2048, 17 MB rather than 196 MB.
"""

from __future__ import annotations

import base64
import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from shared.images.decoding import MAX_DECODED_PIXELS, InvalidImage, decode_image
from shared.images.idefics3 import Idefics3Processing
from shared.wire import WireImage


@dataclass(slots=True)
class SequenceVision:
    """One sequence's pictures, where their features go, and the features once encoded."""

    pictures: list[Image.Image]  # decoded, upright and shrunk; dropped once encoded
    processing: Idefics3Processing
    positions: list[int]  # prompt positions of the image tokens, ascending
    features: torch.Tensor | None = None  # [len(positions), hidden] once encoded

    def between(self, start: int, end: int) -> tuple[int, int]:
        """The index range of ``positions`` inside ``[start, end)``."""
        return bisect.bisect_left(self.positions, start), bisect.bisect_left(self.positions, end)

    def tiles(self) -> torch.Tensor:
        """Every picture's tiles in prompt order, ``[tiles, 3, S, S]``."""
        processed = [self.processing.preprocess(p).pixel_values for p in self.pictures]
        return torch.from_numpy(np.concatenate(processed))


def sequence_vision(
    images: Sequence[WireImage],
    prompt_token_ids: Sequence[int],
    processing: Idefics3Processing,
    image_token_id: int,
    tokens_per_tile: int,
) -> SequenceVision:
    """Decode ``images``; ``ValueError`` when one is not an image or its span does not fit it."""
    pictures: list[Image.Image] = []
    positions: list[int] = []
    for index, image in enumerate(images):
        if not 0 <= image.start < image.end <= len(prompt_token_ids):
            raise ValueError(
                f"image {index}'s span [{image.start}, {image.end}) is not in the prompt"
            )
        try:
            picture = decode_image(base64.b64decode(image.data), MAX_DECODED_PIXELS)
        except InvalidImage as exc:
            raise ValueError(f"image {index} {exc}") from None
        rows, cols = processing.grid(*picture.size)
        expected = (rows * cols + 1) * tokens_per_tile
        span = [p for p in range(image.start, image.end) if prompt_token_ids[p] == image_token_id]
        if len(span) != expected:
            raise ValueError(
                f"image {index} needs {expected} image tokens in its span; "
                f"the prompt has {len(span)}"
            )
        pictures.append(processing.shrink(picture))
        positions += span
    return SequenceVision(pictures, processing, positions)
