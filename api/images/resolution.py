"""The resolution stage: a rendered prompt's image sources to decoded pictures, under a quota.

It runs only for a prompt that has image sources, in the preparation pool,
after rendering, in two steps. ``open_images``: base64 and data URLs are
decoded, http(s) URLs fetched through the destination policy, and every
image's header read and counted against the request's quota (images, bytes,
pixels); no pixel is decoded yet, so preparation can reserve what the images
will cost from their sizes alone. ``decode_images``: each image decoded in
turn, within the process's decoding budget, as the model's image processing
decodes it (Idefics3: to its upright size and pixel digest, its pixels not
kept; DeepSeek V4.1: fitted and re-encoded).

Whose fault a failure is decides its status, as in the reference servers: an
image that is itself unusable (not decodable, not an image, too large, too
many, a URL the server does not fetch from) is a 400, "change the image"; a
failure on the fetching side (the remote host errors, is unreachable or too
slow) is a 502 or 504, "retry later". Each message names the image by its
position in the prompt.
"""

from __future__ import annotations

import base64
import binascii
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from PIL import Image

from api.errors import ApiError, bad_request
from api.images.budget import DecodingBudget
from api.images.destinations import DestinationPolicy
from shared.conversation import ImageDetail, ImageSource
from shared.flags import at_least_one, flag, group
from shared.images.decoding import (
    DecodedImage,
    InvalidImage,
    TooManyPixels,
    decoding_bytes,
    open_image,
)
from shared.images.layout import ImageProcessing

if TYPE_CHECKING:
    from api.images.fetching import ImageFetchError

DEFAULT_MAX_IMAGES = 16
DEFAULT_MAX_IMAGE_BYTES = 20 * 2**20
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
DEFAULT_FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class ImageQuota:
    """What one request's images may add up to; each is a flag of ``sluice serve``."""

    images: int = field(
        default=DEFAULT_MAX_IMAGES,
        metadata=flag(
            "images one request may hold; more is a 400",
            names=("--max-images",),
            parse=at_least_one,
            metavar="N",
        ),
    )
    bytes: int = field(
        default=DEFAULT_MAX_IMAGE_BYTES,
        metadata=flag(
            "encoded bytes one request's images may hold together, inline and fetched",
            names=("--max-image-bytes",),
            parse=at_least_one,
            metavar="N",
        ),
    )
    pixels: int = field(
        default=DEFAULT_MAX_IMAGE_PIXELS,
        metadata=flag(
            "decoded pixels one request's images may hold together",
            names=("--max-image-pixels",),
            parse=at_least_one,
            metavar="N",
        ),
    )


@dataclass(frozen=True, slots=True)
class ImageOptions:
    """How images are resolved: where from (``policy``), how much, and how fast."""

    policy: DestinationPolicy = field(
        default_factory=DestinationPolicy,
        metadata=flag(
            "image URLs may reach this host name, address or network although it is not "
            "public (repeatable; loopback, private, link-local and metadata addresses are "
            "refused)",
            names=("--image-allow",),
            repeat=True,
            metavar="HOST|NET",
            into=DestinationPolicy.allowing,
        ),
    )
    quota: ImageQuota = field(default_factory=ImageQuota, metadata=group())
    fetch_timeout_s: float = field(
        default=DEFAULT_FETCH_TIMEOUT_S,
        metadata=flag(
            "fetching a request's image URLs must end within S seconds, or it is a 504",
            names=("--image-fetch-timeout",),
            parse=float,
            metavar="S",
        ),
    )
    # The process's decoded bytes in flight, shared by every request these options resolve.
    decoding: DecodingBudget = field(default_factory=DecodingBudget, compare=False)


@dataclass(frozen=True, slots=True)
class OpenedImage:
    """One of a request's images: its bytes, and its header read; no pixel decoded yet."""

    index: int  # its position in the prompt, which every error names
    data: bytes
    image: Image.Image  # opened, not loaded
    detail: ImageDetail = "auto"

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) as stored: upright, or turned by the EXIF orientation decoding reads."""
        return self.image.size


def resolve_images(
    sources: list[ImageSource], options: ImageOptions, processing: ImageProcessing | None = None
) -> list[DecodedImage]:
    """Every source decoded, in prompt order; an ``ApiError`` naming the first that fails."""
    return decode_images(open_images(sources, options), options, processing)


def open_images(sources: list[ImageSource], options: ImageOptions) -> list[OpenedImage]:
    """Every source's bytes, in prompt order, opened and counted against the quota from their
    headers; an ``ApiError`` naming the first that fails."""
    quota = options.quota
    check_image_count(len(sources), quota)
    deadline = time.monotonic() + options.fetch_timeout_s
    opened: list[OpenedImage] = []
    used_bytes = used_pixels = 0
    for index, source in enumerate(sources):
        data = _bytes_of(index, source, options, quota.bytes - used_bytes, deadline)
        used_bytes += len(data)
        if used_bytes > quota.bytes:
            raise _over_bytes(index, quota)
        image = _open(index, data, quota.pixels - used_pixels)
        used_pixels += image.width * image.height
        opened.append(OpenedImage(index, data, image, source.detail))
    return opened


def decode_images(
    opened: list[OpenedImage], options: ImageOptions, processing: ImageProcessing | None = None
) -> list[DecodedImage]:
    """Each image decoded in turn as ``processing`` decodes it (by default to its upright size
    and pixel digest), its pixels freed after.

    An image waits for room in the decoding budget, up to the budget's wait
    for the whole request; then it is a 503.
    """
    budget = options.decoding
    deadline = time.monotonic() + budget.wait_s
    return [_decode(image, budget, deadline, processing) for image in opened]


def _open(index: int, data: bytes, max_pixels: int) -> Image.Image:
    try:
        return open_image(data, max_pixels)
    except TooManyPixels as exc:
        raise bad_request(
            f"image {index} {exc} (--max-image-pixels)", "messages", "limit_exceeded"
        ) from None
    except InvalidImage as exc:
        raise _invalid(index, str(exc)) from None


def _decode(
    opened: OpenedImage,
    budget: DecodingBudget,
    deadline: float,
    processing: ImageProcessing | None,
) -> DecodedImage:
    try:
        with budget.holding(decoding_bytes(opened.image), deadline):
            if processing is None:
                return DecodedImage.of(opened.image, opened.data)
            return processing.decode(opened.image, opened.data, opened.detail)
    except InvalidImage as exc:
        raise _invalid(opened.index, str(exc)) from None
    finally:
        opened.image.close()  # the decoded pixels are freed now, not when the request ends


def check_image_count(count: int, quota: ImageQuota) -> None:
    if count > quota.images:
        raise bad_request(
            f"a request may hold at most {quota.images} images (--max-images), "
            f"this one has {count}",
            "messages",
            "limit_exceeded",
        )


def _bytes_of(
    index: int, source: ImageSource, options: ImageOptions, budget: int, deadline: float
) -> bytes:
    if source.data is not None:
        if len(source.data) * 3 // 4 > budget:
            raise _over_bytes(index, options.quota)
        try:
            return base64.b64decode(source.data, validate=True)
        except (binascii.Error, ValueError):
            raise _invalid(index, "is not valid base64") from None
    assert source.url is not None
    from api.images.fetching import ImageFetchError, fetch_image  # loads httpx: URL images only

    try:
        return fetch_image(source.url, options.policy, max_bytes=budget, deadline=deadline).data
    except ImageFetchError as exc:
        raise _fetch_error(index, exc) from None


def _invalid(index: int, reason: str) -> ApiError:
    return bad_request(f"image {index} {reason}", "messages", "invalid_image")


def _over_bytes(index: int, quota: ImageQuota) -> ApiError:
    return bad_request(
        f"image {index} brings the request's images over {quota.bytes} bytes (--max-image-bytes)",
        "messages",
        "limit_exceeded",
    )


def _fetch_error(index: int, error: ImageFetchError) -> ApiError:
    message = f"image {index}: {error}"
    if error.client_fault:
        return bad_request(message, "messages", "invalid_image_url")
    if error.timed_out:
        return ApiError(
            504, message + "; retry later", "api_error", "messages", "image_fetch_timeout"
        )
    return ApiError(502, message + "; retry later", "api_error", "messages", "image_fetch_failed")
