"""Image decoding in bounded memory: the same pixels and digests as whole-picture conversion.

Decoding converts a band of rows at a time; these tests hold it to the
whole-picture conversion it replaces (``reference_picture``), pixel for pixel
and digest for digest, in every mode and orientation an upload can have.
Memory is measured as the peak resident size of a fresh interpreter: Pillow
allocates pixels in C, where ``tracemalloc`` does not look.
"""

from __future__ import annotations

import base64
import hashlib
import io
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

import shared.images.decoding as decoding
from api.errors import ApiError
from api.images.budget import DEFAULT_DECODING_BYTES, DecodingBudget
from api.images.resolution import ImageOptions, resolve_images
from bench.vision_model import make_idefics3
from shared.conversation import ImageSource
from shared.images.decoding import DecodedImage, decode_image, decoding_bytes, open_image

ROOT = Path(__file__).resolve().parents[2]
SIDE = 7000  # a 7000x7000 bilevel PNG: 49 million pixels, a few kilobytes encoded
MB = 2**20


def reference_picture(data: bytes) -> Image.Image:
    """The whole-picture conversion: upright, then RGBA over a white RGBA picture, then RGB."""
    image = Image.open(io.BytesIO(data))
    image.load()
    upright = ImageOps.exif_transpose(image)
    if upright.mode == "RGB":
        return upright
    rgba = upright.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def reference_digest(picture: Image.Image) -> bytes:
    digest = hashlib.blake2b(picture.tobytes(), digest_size=16)
    digest.update(f"{picture.width}x{picture.height}".encode())
    return digest.digest()


def noise(width: int, height: int, bands: int, seed: int = 0) -> np.ndarray:
    shape = (height, width, bands) if bands > 1 else (height, width)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def stored(image: Image.Image, kind: str = "PNG", **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, kind, **options)
    return buffer.getvalue()


def palette_with_transparency(width: int, height: int) -> bytes:
    image = Image.fromarray(noise(width, height, 3)).convert("P", colors=64)
    return stored(image, transparency=5)


SIZE = (301, 203)  # with 1,000-pixel bands: many bands, the last one short


def samples() -> dict[str, bytes]:
    width, height = SIZE
    rgb = Image.fromarray(noise(width, height, 3))
    rgba = Image.fromarray(noise(width, height, 4), "RGBA")
    grey = Image.fromarray(noise(width, height, 1))
    sixteen = Image.fromarray(
        np.random.default_rng(1).integers(0, 65536, (height, width), dtype=np.uint16)
    )
    return {
        "RGB": stored(rgb),
        "RGBA": stored(rgba),
        "P": stored(rgb.convert("P", colors=64)),
        "P with transparency": palette_with_transparency(width, height),
        "LA": stored(rgba.convert("LA")),
        "1": stored(grey.convert("1")),
        "L": stored(grey),
        "L with transparency": stored(grey, transparency=7),
        "RGB with a transparent colour": stored(rgb, transparency=(1, 2, 3)),
        "I;16": stored(sixteen),
        "CMYK": stored(rgb.convert("CMYK"), "JPEG"),
        "GIF with transparency": stored(
            rgb.convert("P", colors=32), "GIF", transparency=3, optimize=False
        ),
        "WebP RGBA": stored(rgba, "WEBP", lossless=True),
    }


@pytest.fixture
def narrow_bands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decoding, "BAND_PIXELS", 1000)


@pytest.mark.usefixtures("narrow_bands")
@pytest.mark.parametrize("name", list(samples()))
def test_band_decoding_equals_whole_picture_conversion(name: str) -> None:
    data = samples()[name]
    expected = reference_picture(data)
    picture = decode_image(data, 10**7)
    assert picture.mode == "RGB" and picture.size == expected.size
    assert np.array_equal(np.asarray(picture), np.asarray(expected)), name
    decoded = DecodedImage.of(open_image(data, 10**7), data)
    assert decoded.digest == reference_digest(expected), name
    assert decoded.size == expected.size and decoded.data == data


def test_the_samples_cover_every_mode_and_transparency() -> None:
    opened = {name: open_image(data, 10**7) for name, data in samples().items()}
    modes = {image.mode for image in opened.values()}
    assert {"RGB", "RGBA", "P", "LA", "1", "L", "I;16", "CMYK"} <= modes
    transparent = {name for name, image in opened.items() if image.has_transparency_data}
    assert {"P with transparency", "L with transparency", "GIF with transparency"} <= transparent


@pytest.mark.usefixtures("narrow_bands")
@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("kind", ["PNG", "JPEG"])
def test_every_exif_orientation_is_applied_band_by_band(orientation: int, kind: str) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    image = Image.fromarray(noise(*SIZE, 4), "RGBA") if kind == "PNG" else None
    image = image or Image.fromarray(noise(*SIZE, 3))
    data = stored(image, kind, exif=exif)
    expected = reference_picture(data)
    assert np.array_equal(np.asarray(decode_image(data, 10**7)), np.asarray(expected))
    decoded = DecodedImage.of(open_image(data, 10**7), data)
    assert (decoded.size, decoded.digest) == (expected.size, reference_digest(expected))
    sideways = orientation >= 5
    assert decoded.size == (SIZE[::-1] if sideways else SIZE)


def test_a_row_wider_than_a_band_is_a_band_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decoding, "BAND_PIXELS", 100)
    data = palette_with_transparency(*SIZE)
    expected = reference_picture(data)
    assert np.array_equal(np.asarray(decode_image(data, 10**7)), np.asarray(expected))
    assert DecodedImage.of(open_image(data, 10**7), data).digest == reference_digest(expected)


# --- memory ----------------------------------------------------------------------

measures_memory = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="reads the peak from /proc (Linux)"
)


def bilevel_png(side: int = SIDE) -> bytes:
    return stored(Image.new("1", (side, side)))


def peak_growth(script: str, *args: str) -> int:
    """How far ``script`` raises a fresh interpreter's peak resident size, in bytes: it
    prepares what it needs, calls ``measure()``, then does the work measured.

    The peak is the kernel's high-water mark of the interpreter's own memory
    (``VmHWM``): ``ru_maxrss`` would start from the test process's, which a
    child inherits across ``exec``.
    """
    prelude = (
        "def peak():\n"
        "    with open('/proc/self/status') as status:\n"
        "        line = next(line for line in status if line.startswith('VmHWM:'))\n"
        "    return int(line.split()[1]) * 1024\n"
        "def measure():\n"
        "    global BASE\n"
        "    BASE = peak()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", prelude + script + "\nprint(peak() - BASE)\n", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return int(done.stdout.split()[-1])


ONE_IMAGE = """
import sys
from pathlib import Path
from shared.images.decoding import DecodedImage, decode_image, open_image
data = Path(sys.argv[1]).read_bytes()
measure()
if sys.argv[2] == "digest":
    decoded = DecodedImage.of(open_image(data, 50_000_000), data)
    assert decoded.size == (7000, 7000)
else:
    assert decode_image(data, 50_000_000).size == (7000, 7000)
"""


@measures_memory
def test_digesting_a_bilevel_picture_holds_it_once_at_a_byte_a_pixel(tmp_path: Path) -> None:
    """The API's decoding: the image in its own mode and one band, never an RGB(A) copy."""
    path = tmp_path / "bilevel.png"
    path.write_bytes(bilevel_png())
    assert path.stat().st_size < 10_000
    band = decoding.BAND_COPIES * 4 * decoding.BAND_PIXELS
    growth = peak_growth(ONE_IMAGE, str(path), "digest")
    print(f"peak growth digesting a {SIDE}x{SIDE} bilevel PNG: {growth / MB:.0f} MiB")
    assert growth < SIDE * SIDE + band + 32 * MB  # whole-picture conversion: about 800 MiB


@measures_memory
def test_decoding_a_bilevel_picture_to_rgb_makes_no_other_copy(tmp_path: Path) -> None:
    """The engine's decoding: the image in its own mode, the RGB picture, one band."""
    path = tmp_path / "bilevel.png"
    path.write_bytes(bilevel_png())
    band = decoding.BAND_COPIES * 4 * decoding.BAND_PIXELS
    growth = peak_growth(ONE_IMAGE, str(path), "rgb")
    print(f"peak growth decoding a {SIDE}x{SIDE} bilevel PNG to RGB: {growth / MB:.0f} MiB")
    assert growth < SIDE * SIDE * (1 + 4) + band + 32 * MB


MANY_REQUESTS = """
import base64, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from api.backends.base import ServedModel
from api.images.budget import ImageTokenBudget
from api.preparation import PreparationContext, prepare
from api.protocols import chat_completions
from shared.images.loading import load_image_processing
from shared.registry import ModelRegistry, ModelSpec
from shared.tokenizer_loader import load_tokenizer

weights, data, count = Path(sys.argv[1]), Path(sys.argv[2]).read_bytes(), int(sys.argv[3])
spec = ModelSpec("seer", weights, capabilities=frozenset({"images"}))
served = ServedModel(spec, load_tokenizer(weights), 4096, load_image_processing(weights))
ctx = PreparationContext(ModelRegistry([spec]), {"seer": served}, image_tokens=ImageTokenBudget())
url = "data:image/png;base64," + base64.b64encode(data).decode()
image = {"type": "image_url", "image_url": {"url": url}}
body = {"model": "seer", "max_tokens": 4, "messages": [{"role": "user", "content": [image]}]}
prepare(chat_completions.PROTOCOL, {**body, "messages": [{"role": "user", "content": "hi"}]}, ctx)
measure()
with ThreadPoolExecutor(count) as pool:
    prepared = list(pool.map(lambda _: prepare(chat_completions.PROTOCOL, body, ctx), range(count)))
assert len({p.wire.images[0].digest for p in prepared}) == 1
assert ctx.image_tokens.used == sum(p.image_tokens.tokens for p in prepared) > 0
"""


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_idefics3(tmp_path_factory.mktemp("vlm"), weights=False)


@measures_memory
def test_eight_huge_images_prepared_at_once_are_decoded_within_the_budget(
    vlm: Path, tmp_path: Path
) -> None:
    """Eight requests, one 7000x7000 bilevel PNG each, prepared on eight threads: the
    decoding budget lets a few decode at once, the rest wait their turn."""
    path = tmp_path / "bilevel.png"
    path.write_bytes(bilevel_png())
    growth = peak_growth(MANY_REQUESTS, str(vlm), str(path), "8")
    print(f"peak growth preparing 8 at once: {growth / MB:.0f} MiB")
    assert growth < DEFAULT_DECODING_BYTES + 64 * MB  # whole-picture conversion: about 6 GiB


def test_decoding_bytes_are_read_from_the_header() -> None:
    band = decoding.BAND_COPIES * 4 * decoding.BAND_PIXELS
    data = {"1": bilevel_png(1000), "RGBA": stored(Image.new("RGBA", (1000, 1000)))}
    assert decoding_bytes(open_image(data["1"], 10**7)) == 1000 * 1000 + band
    assert decoding_bytes(open_image(data["RGBA"], 10**7)) == 4 * 1000 * 1000 + band
    sixteen = stored(Image.fromarray(np.zeros((10, 10), np.uint16)))
    assert decoding_bytes(open_image(sixteen, 10**7)) == 2 * 100 + band


# --- the decoding budget ---------------------------------------------------------


def test_an_image_waits_for_room_in_the_decoding_budget() -> None:
    budget, order = DecodingBudget(100), []
    started = threading.Event()

    def later() -> None:
        with budget.holding(60, time.monotonic() + 5):
            order.append("second")

    with budget.holding(60, time.monotonic() + 5):
        thread = threading.Thread(target=lambda: (started.set(), later()))
        thread.start()
        started.wait()
        time.sleep(0.2)
        order.append("first")
        assert budget.used == 60
    thread.join(5)
    assert order == ["first", "second"] and budget.used == 0


def test_an_image_that_finds_no_room_by_the_deadline_is_a_503() -> None:
    budget = DecodingBudget(100)
    with budget.holding(60, time.monotonic() + 1):
        with pytest.raises(ApiError) as refused, budget.holding(60, time.monotonic() + 0.1):
            raise AssertionError("decoded without room")
        assert budget.used == 60
    assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
    assert "60 bytes" in refused.value.message and "retry" in refused.value.message
    assert budget.used == 0


def test_an_image_larger_than_the_whole_budget_is_decoded_alone() -> None:
    budget = DecodingBudget(100)
    with budget.holding(500, time.monotonic() + 1):
        assert budget.used == 100
    assert budget.used == 0


def test_resolution_decodes_within_the_options_budget() -> None:
    budget = DecodingBudget(10_000, wait_s=0.1)
    source = ImageSource(data=base64.b64encode(bilevel_png(50)).decode(), media_type="image/png")
    with budget.holding(10_000, time.monotonic() + 1), pytest.raises(ApiError) as refused:
        resolve_images([source], ImageOptions(decoding=budget))  # another request decodes
    assert refused.value.status == 503
    [image] = resolve_images([source], ImageOptions(decoding=budget))
    assert image.size == (50, 50) and budget.used == 0
