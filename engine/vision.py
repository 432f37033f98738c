"""A sequence's images in the engine: preprocessed at admission, encoded when first needed.

The prompt holds each image as a span of placeholder tokens (``WireImage``);
the image token's positions inside the spans, in order, are where the vision
encoder's features go. Features are computed for all of a sequence's images
at once, the first time a chunk reaches one of those positions; a prompt
whose images were all served from the prefix cache never runs the encoder.
"""

from __future__ import annotations

import base64
import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from shared.images.decoding import decode_image
from shared.images.idefics3 import Idefics3Processing
from shared.wire import WireImage

# The API enforced the request's pixel quota; this only bounds what a decoder may allocate.
_MAX_PIXELS = 2**28


@dataclass(slots=True)
class SequenceVision:
    """One sequence's preprocessed images and where their features go."""

    pixel_values: torch.Tensor  # every image's tiles, [tiles, 3, S, S]
    positions: list[int]  # prompt positions of the image tokens, ascending
    features: torch.Tensor | None = None  # [len(positions), hidden] once encoded

    def between(self, start: int, end: int) -> tuple[int, int]:
        """The index range of ``positions`` inside ``[start, end)``."""
        return bisect.bisect_left(self.positions, start), bisect.bisect_left(self.positions, end)


def sequence_vision(
    images: Sequence[WireImage],
    prompt_token_ids: Sequence[int],
    processing: Idefics3Processing,
    image_token_id: int,
    tokens_per_tile: int,
) -> SequenceVision:
    """Decode and preprocess ``images``; ``ValueError`` when a span does not fit its image."""
    tiles: list[np.ndarray] = []
    positions: list[int] = []
    for index, image in enumerate(images):
        if not 0 <= image.start < image.end <= len(prompt_token_ids):
            raise ValueError(
                f"image {index}'s span [{image.start}, {image.end}) is not in the prompt"
            )
        picture = decode_image(base64.b64decode(image.data), _MAX_PIXELS)
        processed = processing.preprocess(picture)
        span = [p for p in range(image.start, image.end) if prompt_token_ids[p] == image_token_id]
        expected = len(processed.pixel_values) * tokens_per_tile
        if len(span) != expected:
            raise ValueError(
                f"image {index} needs {expected} image tokens in its span; "
                f"the prompt has {len(span)}"
            )
        tiles.append(processed.pixel_values)
        positions += span
    return SequenceVision(torch.from_numpy(np.concatenate(tiles)), positions)
