"""The image resolution stage against a real HTTP server: SSRF refusals, fetching, quotas, errors.

Every refused URL points at a recording server that would answer it; the
proof of a refusal is that the server received nothing.
"""

from __future__ import annotations

import base64
import io
import ipaddress
import time
from collections.abc import Iterator

import pytest
from PIL import Image

from api.errors import ApiError
from api.images.destinations import DestinationPolicy, UnresolvableHost, system_resolver
from api.images.fetching import ImageFetchError, fetch_image
from api.images.resolution import ImageOptions, ImageQuota, resolve_images
from shared.conversation import ImageSource
from shared.images.decoding import MAX_DECODED_PIXELS, decode_image
from tests.image_server import ImageServer, image_server, png_bytes


@pytest.fixture(scope="module")
def served() -> Iterator[ImageServer]:
    with image_server() as server:
        yield server


@pytest.fixture(scope="module")
def elsewhere() -> Iterator[ImageServer]:
    """A second server, on 127.0.0.2: refused where only 127.0.0.1 is allowed."""
    with image_server("127.0.0.2") as server:
        yield server


@pytest.fixture(autouse=True)
def _forget(served: ImageServer, elsewhere: ImageServer) -> None:
    served.paths.clear()
    elsewhere.paths.clear()


def _resolve(*urls: str, allow: tuple[str, ...] = (), **options: object) -> list:
    policy = DestinationPolicy.allowing(allow, options.pop("resolver", system_resolver))
    return resolve_images([ImageSource(url=url) for url in urls], ImageOptions(policy, **options))


def _error(*urls: str, **options: object) -> ApiError:
    with pytest.raises(ApiError) as caught:
        _resolve(*urls, **options)
    return caught.value


def _inline(data: bytes, media_type: str = "image/png") -> ImageSource:
    return ImageSource(data=base64.b64encode(data).decode(), media_type=media_type)


# --- SSRF ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "localhost",
        "LOCALHOST.",
        "[::1]",
        "2130706433",  # 127.0.0.1 in decimal
        "0x7f000001",  # in hex
        "0x7f.1",  # in dotted hex, the short form
        "0.0.0.0",  # Linux connects this to the loopback
        "[::ffff:127.0.0.1]",  # IPv4-mapped
        "[::ffff:7f00:1]",  # IPv4-mapped, in hex
    ],
)
def test_every_spelling_of_the_loopback_is_refused_and_nothing_is_sent(
    served: ImageServer, host: str
):
    error = _error(f"http://{host}:{served.port}/image.png")
    assert (error.status, error.code) == (400, "invalid_image_url"), error.message
    assert error.message.startswith("image 0: ")
    assert served.paths == []


def test_an_octal_loopback_is_not_a_url_the_server_fetches(served: ImageServer):
    error = _error(f"http://0177.0.0.1:{served.port}/image.png")
    assert (error.status, error.code) == (400, "invalid_image_url")
    assert served.paths == []


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("10.1.2.3", "private"),
        ("172.16.0.9", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "link-local"),  # the cloud metadata address
        ("100.100.100.200", "provider's own services"),  # Alibaba's metadata, in CGNAT space
        ("fd00:ec2::254", "provider's own services"),  # AWS's IPv6 metadata
        ("fe80::1", "link-local"),
        ("fc00::1", "private"),
        ("224.0.0.1", "multicast"),
        ("::", "unspecified"),
        ("::127.0.0.1", "loopback"),  # IPv4-compatible
        ("2002:7f00:1::", "loopback"),  # 6to4 around 127.0.0.1
        ("2002:a00:1::", "private"),  # 6to4 around 10.0.0.1
    ],
)
def test_non_public_addresses_are_refused(address: str, reason: str):
    refusal = DestinationPolicy().refusal(ipaddress.ip_address(address))
    assert refusal is not None and reason in refusal


@pytest.mark.parametrize("address", ["8.8.8.8", "2606:4700:4700::1111", "151.101.1.140"])
def test_public_addresses_are_allowed(address: str):
    assert DestinationPolicy().refusal(ipaddress.ip_address(address)) is None


def test_a_public_looking_name_that_resolves_to_a_private_address_is_refused(served: ImageServer):
    """The resolver answers as an attacker's DNS would; a rebinding name gets one lookup."""
    lookups: list[str] = []

    def rebinding(host: str, port: int) -> list[str]:
        lookups.append(host)
        return ["93.184.216.34", "127.0.0.1"] if host == "images.example.com" else []

    error = _error(f"http://images.example.com:{served.port}/image.png", resolver=rebinding)
    assert error.status == 400 and "127.0.0.1" in error.message and "loopback" in error.message
    assert lookups == ["images.example.com"]
    assert served.paths == []


def test_the_allowed_address_is_fetched_and_used(served: ImageServer):
    [image] = _resolve(f"{served.base}/image.png", allow=("127.0.0.1",))
    picture = decode_image(image.data, MAX_DECODED_PIXELS)
    assert (picture.mode, picture.size, image.size) == ("RGB", (32, 24), (32, 24))
    assert picture.getpixel((0, 0)) == (200, 30, 30)
    assert served.paths == ["/image.png"]


def test_an_allowed_host_name_connects_to_the_address_it_resolved_to(served: ImageServer):
    """The name goes out as the Host header; the connection goes to the checked address."""
    resolved: list[str] = []

    def resolver(host: str, port: int) -> list[str]:
        resolved.append(host)
        return ["127.0.0.1"]

    [image] = _resolve(
        f"http://images.internal:{served.port}/image.png",
        allow=("images.internal",),
        resolver=resolver,
    )
    assert image.size == (32, 24) and resolved == ["images.internal"]


def test_a_network_allows_every_address_in_it(served: ImageServer):
    assert _resolve(f"{served.base}/image.png", allow=("127.0.0.0/8",))


def test_a_redirect_to_a_refused_address_is_refused_before_it_is_followed(
    served: ImageServer, elsewhere: ImageServer
):
    target = f"{elsewhere.base}/image.png"
    error = _error(f"{served.base}/redirect?to={target}", allow=("127.0.0.1",))
    assert error.status == 400 and "127.0.0.2" in error.message
    assert served.paths == [f"/redirect?to={target}"]
    assert elsewhere.paths == []


def test_an_allowed_redirect_is_followed(served: ImageServer):
    [image] = _resolve(f"{served.base}/redirect?to=/image.png", allow=("127.0.0.1",))
    assert image.size == (32, 24)
    assert served.paths == ["/redirect?to=/image.png", "/image.png"]


def test_redirects_are_bounded(served: ImageServer):
    url = f"{served.base}/image.png"
    for _ in range(4):
        url = f"{served.base}/redirect?to={url}"
    error = _error(url, allow=("127.0.0.1",))
    assert error.status == 502 and "redirects" in error.message
    assert len(served.paths) == 4


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/image.png", "file:///etc/passwd", "gopher://x/"])
def test_only_http_and_https_are_fetched(url: str):
    error = _error(url, allow=("127.0.0.1",))
    assert (error.status, error.code) == (400, "invalid_image_url")
    assert "only http and https" in error.message


# --- malformed hosts -----------------------------------------------------------


def _fetch_failure(url: str, addresses: list[str]) -> tuple[ImageFetchError, list[str]]:
    """What fetching ``url`` raises, when every name resolves to ``addresses``; and the
    names that were resolved."""
    resolved: list[str] = []

    def resolver(name: str, port: int) -> list[str]:
        resolved.append(name)
        return addresses

    with pytest.raises(ImageFetchError) as caught:
        fetch_image(
            url,
            DestinationPolicy(resolver=resolver),
            max_bytes=2**20,
            deadline=time.monotonic() + 5,
        )
    return caught.value, resolved


@pytest.mark.parametrize(
    "host",
    [
        "xn--localhost-",  # an A-label that decodes to ASCII: invalid punycode for IDNA
        "xn--",  # an A-label with nothing after its prefix
        "xn--a",  # punycode for U+0080, a control character
        "xn--zz-",
        "images.xn--localhost-",  # the invalid A-label after the first label
        "xn--55qx5d.xn--",
        "a" * 64 + ".example.com",  # a label over 63 characters
        ".".join(["a" * 63] * 4) + ".com",  # a name over 253 characters
        "a..example.com",  # an empty label
        ".example.com",
        "a%00b.example.com",  # a NUL, percent-encoded
        "ex%20ample.com",
        "a!b.example.com",
        "[fe80::1%25eth0]",  # an IPv6 zone index
    ],
)
def test_a_malformed_host_is_the_clients_fault_and_is_not_resolved(host: str):
    failure, resolved = _fetch_failure(f"http://{host}:8399/a", ["127.0.0.1"])
    assert failure.client_fault and not failure.timed_out
    assert "not a valid name or address" in str(failure), str(failure)
    assert resolved == []


def test_an_invalid_punycode_host_is_a_400_naming_the_image():
    error = _error("http://xn--localhost-:8399/a", resolver=lambda host, port: ["127.0.0.1"])
    assert (error.status, error.code) == (400, "invalid_image_url")
    assert error.message.startswith("image 0: ") and "xn--localhost-" in error.message


@pytest.mark.parametrize("host", ["xn--localhost-", "images.xn--localhost-", "a..example.com"])
def test_a_redirect_to_a_malformed_host_is_a_400(served: ImageServer, host: str):
    """httpx decodes a redirect's host as it reads the answer, before the policy sees it."""
    error = _error(f"{served.base}/redirect?to=http://{host}:1/", allow=("127.0.0.1",))
    assert (error.status, error.code) == (400, "invalid_image_url"), error.message
    assert host in error.message
    assert served.paths == [f"/redirect?to=http://{host}:1/"]


@pytest.mark.parametrize("port", ["0", "65536", "99999"])
def test_a_port_out_of_range_is_the_clients_fault(port: str):
    failure, _ = _fetch_failure(f"http://images.example.com:{port}/a", ["93.184.216.34"])
    assert failure.client_fault and f"port {port}" in str(failure)


@pytest.mark.parametrize(
    "host",
    ["bücher.example", "xn--bcher-kva.example", "images.xn--bcher-kva.example", "a_b.example"],
)
def test_a_well_formed_name_is_resolved_in_its_ascii_form(host: str):
    failure, resolved = _fetch_failure(f"http://{host}/a", ["127.0.0.1"])
    assert failure.client_fault and "loopback" in str(failure)
    assert resolved == [host.replace("bücher", "xn--bcher-kva")]


# --- the error split ------------------------------------------------------------


@pytest.mark.parametrize("status", [404, 500, 403])
def test_a_remote_error_is_a_502(served: ImageServer, status: int):
    error = _error(f"{served.base}/status/{status}", allow=("127.0.0.1",))
    assert (error.status, error.code) == (502, "image_fetch_failed")
    assert f"HTTP {status}" in error.message and "retry later" in error.message


def test_a_slow_remote_is_a_504_within_the_fetch_timeout(served: ImageServer):
    started = time.monotonic()
    error = _error(f"{served.base}/slow", allow=("127.0.0.1",), fetch_timeout_s=0.5)
    assert (error.status, error.code) == (504, "image_fetch_timeout")
    assert time.monotonic() - started < 2.5


def test_an_unresolvable_host_is_a_502():
    def failing(host: str, port: int) -> list[str]:
        raise UnresolvableHost(f"the host {host!r} could not be resolved")

    error = _error("http://no-such-host.example/image.png", resolver=failing)
    assert (error.status, error.code) == (502, "image_fetch_failed")


def test_a_refused_connection_is_a_502():
    error = _error("http://127.0.0.1:9/image.png", allow=("127.0.0.1",))
    assert (error.status, error.code) == (502, "image_fetch_failed")


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("/page.html", "not an image (content type 'text/html')"),
        ("/garbage.png", "is not a JPEG, PNG, GIF or WebP image"),
    ],
)
def test_what_is_not_an_image_is_a_400(served: ImageServer, path: str, words: str):
    error = _error(f"{served.base}{path}", allow=("127.0.0.1",))
    assert error.status == 400 and words in error.message


def test_the_image_is_named_by_its_position(served: ImageServer):
    good = f"{served.base}/image.png"
    error = _error(good, good, f"{served.base}/page.html", allow=("127.0.0.1",))
    assert error.message.startswith("image 2: ")


# --- quotas ----------------------------------------------------------------------


def test_too_many_images_is_a_400_naming_the_limit():
    sources = [_inline(png_bytes())] * 3
    with pytest.raises(ApiError) as caught:
        resolve_images(sources, ImageOptions(quota=ImageQuota(images=2)))
    assert (caught.value.status, caught.value.code) == (400, "limit_exceeded")
    assert "at most 2 images (--max-images), this one has 3" in caught.value.message


def test_fetched_bytes_count_against_the_byte_quota(served: ImageServer):
    error = _error(f"{served.base}/large.png", allow=("127.0.0.1",), quota=ImageQuota(bytes=2**20))
    assert error.status == 400 and "--max-image-bytes" in error.message


def test_inline_bytes_count_against_the_byte_quota():
    image = png_bytes(64, 64)
    quota = ImageQuota(bytes=len(image) + 10)
    assert resolve_images([_inline(image)], ImageOptions(quota=quota))
    with pytest.raises(ApiError) as caught:
        resolve_images([_inline(image), _inline(image)], ImageOptions(quota=quota))
    assert caught.value.status == 400 and caught.value.message.startswith("image 1 ")
    assert "--max-image-bytes" in caught.value.message


def test_pixels_are_counted_across_images():
    quota = ImageQuota(pixels=32 * 24 + 100)
    assert resolve_images([_inline(png_bytes())], ImageOptions(quota=quota))
    with pytest.raises(ApiError) as caught:
        resolve_images([_inline(png_bytes())] * 2, ImageOptions(quota=quota))
    assert (caught.value.status, caught.value.code) == (400, "limit_exceeded")
    assert "--max-image-pixels" in caught.value.message


def test_a_decompression_bomb_is_refused_from_its_header():
    """A 9000x9000 PNG of one colour is a few kB; it is refused before decoding."""
    buffer = io.BytesIO()
    Image.new("1", (9000, 9000)).save(buffer, "PNG")
    started = time.process_time()
    with pytest.raises(ApiError) as caught:
        resolve_images([_inline(buffer.getvalue())], ImageOptions(quota=ImageQuota(pixels=10**6)))
    assert time.process_time() - started < 0.5
    assert "9000x9000" in caught.value.message and "--max-image-pixels" in caught.value.message
    # Beyond Pillow's own bound (2 x 89M pixels), whatever the quota, the same refusal.
    buffer = io.BytesIO()
    Image.new("1", (20000, 10000)).save(buffer, "PNG")
    with pytest.raises(ApiError) as caught:
        resolve_images([_inline(buffer.getvalue())], ImageOptions(quota=ImageQuota(pixels=10**9)))
    assert caught.value.code == "limit_exceeded" and "--max-image-pixels" in caught.value.message


# --- decoding --------------------------------------------------------------------


def test_invalid_base64_is_a_400():
    source = ImageSource(data="not base64!", media_type="image/png")
    with pytest.raises(ApiError) as caught:
        resolve_images([source], ImageOptions())
    assert (caught.value.status, caught.value.code) == (400, "invalid_image")


def test_a_truncated_image_is_a_400():
    buffer = io.BytesIO()
    Image.effect_noise((64, 64), 50).convert("RGB").save(buffer, "JPEG")
    with pytest.raises(ApiError) as caught:
        resolve_images([_inline(buffer.getvalue()[:300], "image/jpeg")], ImageOptions())
    assert (caught.value.status, caught.value.code) == (400, "invalid_image")
    assert "could not be" in caught.value.message


def test_an_unsupported_format_is_a_400():
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, "BMP")
    with pytest.raises(ApiError) as caught:
        resolve_images([_inline(buffer.getvalue(), "image/bmp")], ImageOptions())
    assert "is not a JPEG, PNG, GIF or WebP image" in caught.value.message


def test_exif_orientation_is_applied():
    buffer = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90° clockwise
    Image.new("RGB", (40, 10), (0, 0, 255)).save(buffer, "JPEG", exif=exif)
    [image] = resolve_images([_inline(buffer.getvalue(), "image/jpeg")], ImageOptions())
    assert image.size == decode_image(image.data, MAX_DECODED_PIXELS).size == (10, 40)


def test_transparency_is_laid_over_white():
    [image] = resolve_images([_inline(png_bytes(color=(0, 0, 0, 0)))], ImageOptions())
    picture = decode_image(image.data, MAX_DECODED_PIXELS)
    assert (picture.mode, picture.getpixel((0, 0))) == ("RGB", (255, 255, 255))


def test_equal_pixels_have_equal_digests_whatever_their_encoding():
    pixels = Image.effect_noise((16, 16), 40).convert("RGB")
    encoded = {}
    for kind in ("PNG", "WEBP"):
        buffer = io.BytesIO()
        pixels.save(buffer, kind, **({"lossless": True} if kind == "WEBP" else {}))
        encoded[kind] = buffer.getvalue()
    png, webp = resolve_images(
        [_inline(encoded["PNG"]), _inline(encoded["WEBP"], "image/webp")], ImageOptions()
    )
    assert encoded["PNG"] != encoded["WEBP"] and png.digest == webp.digest
    [other] = resolve_images([_inline(png_bytes(16, 16))], ImageOptions())
    assert other.digest != png.digest


def test_detail_travels_with_the_image_and_an_unknown_level_is_refused():
    from api.protocols import chat_completions, responses

    url = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    for detail in ("auto", "low", "high", "original", "medium"):
        chat = {"type": "image_url", "image_url": {"url": url, "detail": detail}}
        answer = {"type": "input_image", "image_url": url, "detail": detail}
        bodies = [
            (chat_completions, {"model": "m", "messages": [{"role": "user", "content": [chat]}]}),
            (responses, {"model": "m", "input": [{"role": "user", "content": [answer]}]}),
        ]
        for protocol, body in bodies:
            if detail != "medium":
                [message] = protocol.PROTOCOL.parse(body).conversation.messages
                assert message.content[0].source.detail == detail
                continue
            with pytest.raises(ApiError) as refused:
                protocol.PROTOCOL.parse(body)
            assert refused.value.status == 400 and "'original'" in refused.value.message
            assert refused.value.param.endswith("detail")
