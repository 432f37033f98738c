"""DeepSeek V4.1's images: fitted by deepseek-recipe, each a run of image tokens in the prompt.

The recipe's preprocessing (OpenCV, in its Rust core) fits a picture to the
V4.1 image token specification: a long side of at most a few hundred pixels at
``low`` detail, then a token budget, and re-encodes it as WebP, which is what
an inference backend reads. The image's token count follows from the fitted
size alone, so the prompt's one ``<｜image｜>`` per image becomes exactly as
many image tokens as the vision encoder fills, and usage, ``count_tokens`` and
``max_tokens`` count them.

Preprocessing runs through the recipe's own ``ImageResolver`` on bytes the API
has already fetched or decoded from base64, so its options are the
reference's; its fetcher is never used.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import ClassVar

import deepseek_recipe as recipe
from PIL import Image

from shared.conversation import ImageDetail
from shared.images.decoding import DecodedImage, InvalidImage

IMAGE = "<｜image｜>"
# What one image is expected to take before it is fitted: the specification's token budget,
# rounded up. The reservation is settled to the exact count once the image is fitted.
EXPECTED_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class DeepseekImages:
    """V4.1's image processing; stateless, one for every V4.1 model."""

    placeholder: ClassVar[str] = IMAGE
    details: ClassVar[tuple[ImageDetail, ...]] = ("auto", "low", "high", "original")

    def decode(self, image: Image.Image, data: bytes, detail: ImageDetail) -> DecodedImage:
        """``data`` (opened as ``image``, whose header the quota has checked) fitted and
        re-encoded: the WebP bytes a backend reads, their fitted (width, height), and a digest
        of both. ``InvalidImage`` when the recipe refuses it."""
        source = recipe.BytesImageSource(data, detail)
        try:
            [fitted] = _resolver().resolve([source], recipe.ImageQuota()).images
        except (recipe.ImageError, recipe.CalcResizeError) as exc:
            raise InvalidImage(f"was refused by the image preprocessing: {_reason(exc)}") from None
        size = (fitted.width, fitted.height)
        digest = hashlib.blake2b(fitted.data, digest_size=16)
        digest.update(f"{size[0]}x{size[1]}".encode())
        return DecodedImage(fitted.data, size, digest.digest())

    def layout(self, size: tuple[int, int]) -> str:
        """The prompt text a fitted picture of ``size`` becomes: its count of image tokens."""
        return IMAGE * image_tokens(size)


def image_tokens(size: tuple[int, int]) -> int:
    """The image tokens a picture fitted to ``size`` (width, height) takes, as the V4.1
    specification counts them: one placeholder and the recipe's adjustment beyond it."""
    fitted = recipe.ImageInfo(b"", *size)
    return 1 + recipe.MultiModalData([fitted]).image_token_adjustment()


def _resolver() -> recipe.ImageResolver:
    return recipe.ImageResolver(recipe.ReqwestImageFetcher(), recipe.OpenCvImagePreprocessor())


def _reason(error: Exception) -> str:
    """The recipe's message without its ``image[0]: `` prefix: preparation names the image."""
    message = str(error)
    return message.split(": ", 1)[1] if message.startswith("image[") else message
