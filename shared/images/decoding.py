"""Image bytes to an upright RGB picture, or its digest, refusing what is not one or is too big.

Only JPEG, PNG, GIF and WebP are opened (the formats every protocol
documents). The size is read from the header and checked against the pixel
budget before a single pixel is decoded, so a small file that would inflate
to gigabytes is refused for the cost of its header.

A decoded image is held once, in the mode it is stored in (a byte a pixel
for a bilevel, grey or palette image, four for colour), and is turned upright
and converted to RGB a band of rows at a time. A 7000x7000 bilevel PNG of a
few kilobytes is 49 MB decoded; whole-picture RGBA copies would make it close
to a gigabyte. The digest is computed from the same bands, so the API never
builds the RGB picture at all; ``decode_image`` builds it for the encoder.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from PIL import ExifTags, Image, ImageMode, UnidentifiedImageError
from PIL.Image import Transpose

FORMATS = ("JPEG", "PNG", "GIF", "WEBP")
# What a decoder may allocate where the images were bounded before (the API's quota) or
# chosen by the caller (offline): only a guard against a header that lies.
MAX_DECODED_PIXELS = 2**28
BAND_PIXELS = 2**18  # pixels converted at once: 1 MiB as RGBA
# Copies of a band while it is converted: its crop, turned, as RGBA, the white under it,
# composited, as RGB, and its bytes for the digest.
BAND_COPIES = 7
WHITE = (255, 255, 255, 255)

# An EXIF orientation, and the transposition that makes the picture upright
# (as ``ImageOps.exif_transpose`` reads it).
UPRIGHT = {
    2: Transpose.FLIP_LEFT_RIGHT,
    3: Transpose.ROTATE_180,
    4: Transpose.FLIP_TOP_BOTTOM,
    5: Transpose.TRANSPOSE,
    6: Transpose.ROTATE_270,
    7: Transpose.TRANSVERSE,
    8: Transpose.ROTATE_90,
}
# The transpositions that make rows of columns.
_SIDEWAYS = (Transpose.TRANSPOSE, Transpose.ROTATE_270, Transpose.TRANSVERSE, Transpose.ROTATE_90)


@dataclass(frozen=True, slots=True)
class DecodedImage:
    """An image's encoded bytes, its upright size, and the digest of its pixels (the prefix
    cache's key for it: equal pixels, equal digest, whatever the encoding they came in).

    The pixels are not kept: laying the image out in the prompt needs only its
    size, and whoever encodes it decodes ``data`` again.
    """

    data: bytes
    size: tuple[int, int]  # (width, height), upright
    digest: bytes

    @classmethod
    def of(cls, image: Image.Image, data: bytes) -> DecodedImage:
        """``image`` (``data`` as ``open_image`` opened it, or any picture) decoded and digested
        a band at a time: blake2b of its upright RGB bytes, then of ``"WxH"``.

        ``InvalidImage`` when its pixels cannot be decoded.
        """
        digest = hashlib.blake2b(digest_size=16)
        with _decoding():
            image.load()
            turn = _turn(image)
            for band in _rgb_bands(image, turn):
                digest.update(band.tobytes())
        width, height = upright_size(image.size, turn)
        digest.update(f"{width}x{height}".encode())
        return cls(data, (width, height), digest.digest())


class InvalidImage(Exception):
    """The bytes are not a usable image: the client's, a 400."""


class TooManyPixels(InvalidImage):
    """A real image, larger than the pixel budget."""


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """``data`` opened, not decoded: a JPEG, PNG, GIF or WebP of at most ``max_pixels``, as its
    header says."""
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
    return image


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """The first frame of ``data`` as RGB, EXIF orientation applied, at most ``max_pixels``.

    It holds the decoded image and the RGB picture, and one band being converted.
    """
    image = open_image(data, max_pixels)
    with _decoding():
        image.load()
        turn = _turn(image)
        if image.mode == "RGB" and turn is None:
            return image
        picture = Image.new("RGB", upright_size(image.size, turn))
        top = 0
        for band in _rgb_bands(image, turn):
            picture.paste(band, (0, top))
            top += band.height
        return picture


def decoding_bytes(image: Image.Image) -> int:
    """What digesting an opened ``image`` holds at once, read from its header: the decoded
    image as Pillow stores it (a byte a pixel for bilevel, grey and palette modes, two for
    16-bit grey, four for the rest) and the copies of one band."""
    width, height = image.size
    mode = ImageMode.getmode(image.mode)
    per_pixel = int(mode.typestr[-1]) if len(mode.bands) == 1 else 4
    return width * height * per_pixel + BAND_COPIES * 4 * max(BAND_PIXELS, width, height)


def upright_size(size: tuple[int, int], turn: Image.Transpose | None) -> tuple[int, int]:
    """The (width, height) of a picture stored at ``size`` once ``turn`` makes it upright."""
    return (size[1], size[0]) if turn in _SIDEWAYS else size


@contextmanager
def _decoding() -> Iterator[None]:
    try:
        yield
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise InvalidImage(f"could not be decoded ({exc})") from exc


def _turn(image: Image.Image) -> Image.Transpose | None:
    """The transposition that makes a decoded ``image`` upright; None when it is."""
    return UPRIGHT.get(image.getexif().get(ExifTags.Base.Orientation, 1))


def _rgb_bands(image: Image.Image, turn: Image.Transpose | None) -> Iterator[Image.Image]:
    """The upright RGB picture of a decoded ``image``, a band of rows at a time, top first."""
    width, height = upright_size(image.size, turn)
    rows = max(1, BAND_PIXELS // width)
    for top in range(0, height, rows):
        yield _rgb(_upright_rows(image, turn, top, min(top + rows, height)))


def _upright_rows(
    image: Image.Image, turn: Image.Transpose | None, top: int, bottom: int
) -> Image.Image:
    """Rows ``[top, bottom)`` of the upright picture: the stored rows or columns they come
    from, cut out and turned."""
    width, height = image.size
    if turn in (None, Transpose.FLIP_LEFT_RIGHT):
        box = (0, top, width, bottom)
    elif turn in (Transpose.ROTATE_180, Transpose.FLIP_TOP_BOTTOM):
        box = (0, height - bottom, width, height - top)
    elif turn in (Transpose.TRANSPOSE, Transpose.ROTATE_270):
        box = (top, 0, bottom, height)
    else:  # Transpose.TRANSVERSE, Transpose.ROTATE_90
        box = (width - bottom, 0, width - top, height)
    band = image.crop(box)
    return band if turn is None else band.transpose(turn)


def _rgb(image: Image.Image) -> Image.Image:
    """RGB, with transparency laid over white (as transformers' processors convert).

    Without transparency, converting straight to RGB gives the pixels the way
    through RGBA gives. An RGB image is taken as it is, transparent colour or not.
    """
    if image.mode == "RGB":
        return image
    if not image.has_transparency_data:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, WHITE), rgba).convert("RGB")
