"""Image bytes to an upright RGB picture, refusing what is not one or is too big to decode.

Only JPEG, PNG, GIF and WebP are opened (the formats every protocol
documents). The size is read from the header and checked against the pixel
budget before a single pixel is decoded, so a small file that would inflate
to gigabytes is refused for the cost of its header.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

FORMATS = ("JPEG", "PNG", "GIF", "WEBP")
# What a decoder may allocate where the images were bounded before (the API's quota) or
# chosen by the caller (offline): only a guard against a header that lies.
MAX_DECODED_PIXELS = 2**28


@dataclass(frozen=True, slots=True)
class DecodedImage:
    """A decoded RGB picture, its encoded bytes, and the digest of its pixels (the prefix
    cache's key for it: equal pixels, equal digest, whatever the encoding they came in)."""

    image: Image.Image
    data: bytes
    digest: bytes

    @classmethod
    def of(cls, image: Image.Image, data: bytes) -> DecodedImage:
        digest = hashlib.blake2b(image.tobytes(), digest_size=16)
        digest.update(f"{image.width}x{image.height}".encode())
        return cls(image, data, digest.digest())


class InvalidImage(Exception):
    """The bytes are not a usable image: the client's, a 400."""


class TooManyPixels(InvalidImage):
    """A real image, larger than the pixel budget."""


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """The first frame of ``data`` as RGB, EXIF orientation applied, at most ``max_pixels``."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError as exc:
        raise InvalidImage("is not a JPEG, PNG, GIF or WebP image") from exc
    except Image.DecompressionBombError as exc:  # Pillow's own bound, far above ours
        raise TooManyPixels(
            f"has more pixels than the {max_pixels} the request's images have left ({exc})"
        ) from exc
    except (OSError, ValueError) as exc:
        raise InvalidImage(f"could not be read ({exc})") from exc
    width, height = image.size
    if width * height > max_pixels:
        raise TooManyPixels(
            f"has {width}x{height} = {width * height} pixels, more than the {max_pixels} "
            "the request's images have left"
        )
    try:
        image.load()
        upright = ImageOps.exif_transpose(image)
        return _rgb(upright)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise InvalidImage(f"could not be decoded ({exc})") from exc


def _rgb(image: Image.Image) -> Image.Image:
    """RGB, with transparency laid over white (as transformers' processors convert)."""
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")
