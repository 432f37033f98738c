"""Idefics3 (SmolVLM) image processing: a picture to encoder tiles, and its place in the prompt.

The picture is resized so its longest edge is the processor's ``size``, then
up to the next multiple of the encoder's tile size ``S`` on each side; a
picture larger than one tile is cut into ``rows x cols`` tiles, row-major,
followed by the whole picture resized to one tile. Tiles are rescaled and
normalized as the checkpoint's ``preprocessor_config.json`` says. The prompt
gives each tile ``image_seq_len`` image tokens between markers naming its row
and column. This mirrors transformers' ``Idefics3ImageProcessorPil`` and
``Idefics3Processor`` (numpy and Pillow only: the API imports it, not torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from PIL import Image

from shared.conversation import ImageDetail
from shared.images.decoding import DecodedImage

MAX_IMAGE_SIZE = 4096  # the longest edge a picture is ever resized to

IMAGE = "<image>"
FAKE_IMAGE = "<fake_token_around_image>"
GLOBAL_IMAGE = "<global-img>"


@dataclass(frozen=True, slots=True)
class ProcessedImage:
    pixel_values: np.ndarray  # [tiles, 3, S, S] float32: rows * cols tiles, then the whole
    rows: int  # 0 when the picture is one tile
    cols: int


@dataclass(frozen=True, slots=True)
class Idefics3Processing:
    longest_edge: int  # the picture's longest edge before tiling
    tile_size: int  # the encoder's input size S
    splitting: bool
    resample: Image.Resampling
    rescale_factor: float | None
    mean: tuple[float, float, float] | None
    std: tuple[float, float, float] | None
    image_seq_len: int  # image tokens per tile

    placeholder: ClassVar[str] = IMAGE
    # Every picture is read at full resolution: ``low`` (fewer tokens) is not served.
    details: ClassVar[tuple[ImageDetail, ...]] = ("auto", "high", "original")

    @classmethod
    def from_hf(cls, config: dict[str, Any], image_seq_len: int) -> Idefics3Processing:
        """From ``preprocessor_config.json`` and the encoder's tokens per tile."""
        tile = config.get("max_image_size", {"longest_edge": 364})["longest_edge"]
        size = (
            config.get("size", {"longest_edge": 4 * tile}) if config.get("do_resize", True) else {}
        )
        normalize = config.get("do_normalize", True)
        return cls(
            longest_edge=size.get("longest_edge", 0),
            tile_size=tile,
            splitting=bool(config.get("do_image_splitting", True)),
            resample=Image.Resampling(config.get("resample", Image.Resampling.LANCZOS)),
            rescale_factor=config.get("rescale_factor", 1 / 255)
            if config.get("do_rescale", True)
            else None,
            mean=tuple(config.get("image_mean", (0.5, 0.5, 0.5))) if normalize else None,
            std=tuple(config.get("image_std", (0.5, 0.5, 0.5))) if normalize else None,
            image_seq_len=image_seq_len,
        )

    def decode(self, image: Image.Image, data: bytes, detail: ImageDetail) -> DecodedImage:
        """``image`` (``data``, opened) decoded to its upright size and pixel digest; the
        engine's host preprocesses ``data`` again."""
        return DecodedImage.of(image, data)

    def layout(self, size: tuple[int, int]) -> str:
        """The prompt text an upright picture of ``size`` (width, height) becomes."""
        return prompt_string(*self.grid(*size), self.image_seq_len)

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """The ``(rows, cols)`` of tiles a ``width x height`` picture becomes; (0, 0): one."""
        if not self.splitting:
            return 0, 0
        return self._split(*self._tiled_size(*self._resized_size(height, width)))

    def shrink(self, image: Image.Image) -> Image.Image:
        """The smallest picture whose tiles are ``image``'s: ``image`` resized as ``preprocess``
        resizes it first, when that makes it smaller and ``preprocess`` would resize the result
        no further; else ``image`` itself.

        A picture waiting for the encoder is kept so: whatever a photo's size,
        its tiles are cut from it resized to ``longest_edge``.
        """
        height, width = self._resized_size(image.height, image.width)
        if width * height >= image.width * image.height:
            return image
        if self._resized_size(height, width) != (height, width):  # resizing twice would differ
            return image
        return self._resize(image, height, width)

    def preprocess(self, image: Image.Image) -> ProcessedImage:
        """An RGB picture's tiles, as the encoder reads them."""
        height, width = self._resized_size(image.height, image.width)
        image = self._resize(image, height, width)
        tile = self.tile_size
        if not self.splitting:
            tiles, rows, cols = [self._resize(image, tile, tile)], 0, 0
        else:
            image = self._resize(image, *self._tiled_size(image.height, image.width))
            rows, cols = self._split(image.height, image.width)
            tiles = [
                image.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile))
                for r in range(rows)
                for c in range(cols)
            ]
            tiles.append(self._resize(image, tile, tile) if tiles else image)
        return ProcessedImage(np.stack([self._normalize(t) for t in tiles]), rows, cols)

    def _resized_size(self, height: int, width: int) -> tuple[int, int]:
        """The longest edge made ``longest_edge`` (the other even), then within the bound."""
        if self.longest_edge:
            height, width = _scale_to_longest(height, width, self.longest_edge)
        return _scale_below(height, width, MAX_IMAGE_SIZE)

    def _tiled_size(self, height: int, width: int) -> tuple[int, int]:
        """Each side up to a multiple of the tile size, the longer one first."""
        tile, aspect = self.tile_size, width / height
        if width >= height:
            width = math.ceil(width / tile) * tile
            height = math.ceil(int(width / aspect) / tile) * tile
        else:
            height = math.ceil(height / tile) * tile
            width = math.ceil(int(height * aspect) / tile) * tile
        return height, width

    def _split(self, height: int, width: int) -> tuple[int, int]:
        """Rows and columns of whole tiles in a tiled size; (0, 0) when it is one tile."""
        tile = self.tile_size
        if height <= tile and width <= tile:
            return 0, 0
        return (height - tile) // tile + 1, (width - tile) // tile + 1

    def _resize(self, image: Image.Image, height: int, width: int) -> Image.Image:
        if image.size == (width, height):
            return image
        return image.resize((width, height), resample=self.resample)

    def _normalize(self, image: Image.Image) -> np.ndarray:
        pixels = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)
        if self.rescale_factor is not None:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        pixels = pixels.astype(np.float32)
        if self.mean is not None and self.std is not None:
            mean = np.array(self.mean, np.float32)[:, None, None]
            std = np.array(self.std, np.float32)[:, None, None]
            pixels = (pixels - mean) / std
        return pixels


def prompt_string(rows: int, cols: int, image_seq_len: int) -> str:
    """The markup one image becomes in the prompt: each tile's tokens, then the whole's."""
    tokens = IMAGE * image_seq_len
    whole = f"{FAKE_IMAGE}{GLOBAL_IMAGE}{tokens}{FAKE_IMAGE}"
    if rows == cols == 0:
        return whole
    grid = "".join(
        "".join(f"{FAKE_IMAGE}<row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols)) + "\n"
        for r in range(rows)
    )
    return f"{grid}\n{whole}"


def _scale_to_longest(height: int, width: int, longest: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def _scale_below(height: int, width: int, bound: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height and width > bound:
        width, height = bound, int(bound / aspect)
    elif height > width and height > bound:
        height, width = bound, int(bound * aspect)
    return max(height, 1), max(width, 1)
