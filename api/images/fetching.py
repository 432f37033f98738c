"""Fetching an image URL through the destination policy, within a deadline and a size.

Each hop (the URL, then every redirect) is parsed, resolved once, checked and
connected to by the checked address; the original host still goes out as the
``Host`` header and, for https, as the TLS server name the certificate is
verified against. The host is used in its ASCII form (IDNA A-labels), the one
DNS, TLS and the ``Host`` header all see; a host that is no valid name or
address (bad punycode, an empty or overlong label, a character DNS names do
not hold) is the URL's fault and is never resolved. Environment proxies are
ignored: a proxy would connect on the server's behalf to an address nobody
checked. The body streams in and stops at the byte budget; only ``image/*``
content types are read.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import httpx

from api.images.destinations import DestinationPolicy, RefusedDestination, UnresolvableHost

MAX_REDIRECTS = 3
CONNECT_TIMEOUT_S = 5.0
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_LABEL = re.compile(r"[a-z0-9_-]+")  # the URL's host comes lowercased
_MAX_LABEL = 63
_MAX_NAME = 253


class ImageFetchError(Exception):
    """A failed fetch: ``client_fault`` is the URL's fault (400), else the fetching side's (5xx)."""

    def __init__(self, reason: str, *, client_fault: bool, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.client_fault = client_fault
        self.timed_out = timed_out


@dataclass(frozen=True, slots=True)
class Fetched:
    data: bytes
    media_type: str


def fetch_image(url: str, policy: DestinationPolicy, *, max_bytes: int, deadline: float) -> Fetched:
    """The image at ``url`` (at most ``max_bytes``), by ``deadline`` (``time.monotonic``)."""
    with httpx.Client(trust_env=False, follow_redirects=False, verify=True) as client:
        for _ in range(MAX_REDIRECTS + 1):
            response = _send(client, url, policy, deadline)
            try:
                if response.status_code in _REDIRECTS and "location" in response.headers:
                    url = str(httpx.URL(url).join(response.headers["location"]))
                    continue
                return _read(url, response, max_bytes, deadline)
            finally:
                response.close()
    raise ImageFetchError(f"more than {MAX_REDIRECTS} redirects", client_fault=False)


def _send(
    client: httpx.Client, url: str, policy: DestinationPolicy, deadline: float
) -> httpx.Response:
    target = _parse(url)
    host = target.raw_host.decode("ascii")
    port = target.port or _DEFAULT_PORTS[target.scheme]
    try:
        address = policy.address_for(host, port)
    except RefusedDestination as exc:
        raise ImageFetchError(f"{url} is not fetched: {exc}", client_fault=True) from exc
    except UnresolvableHost as exc:
        raise ImageFetchError(str(exc), client_fault=False) from exc
    extensions: dict[str, object] = {"timeout": _timeout(_left(deadline))}
    if target.scheme == "https":
        extensions["sni_hostname"] = host
    request = client.build_request(
        "GET",
        target.copy_with(host=address),
        headers={"Host": target.netloc.decode("ascii"), "Accept": "image/*"},
        extensions=extensions,
    )
    try:
        return client.send(request, stream=True)
    except UnicodeError as exc:  # httpx decodes a redirect's host, even one it does not follow
        raise ImageFetchError(
            f"{url} redirects to a host that is not valid IDNA ({exc})", client_fault=True
        ) from exc
    except httpx.TimeoutException as exc:
        raise ImageFetchError(f"{url} timed out", client_fault=False, timed_out=True) from exc
    except httpx.HTTPError as exc:
        raise ImageFetchError(f"{url} could not be fetched ({exc})", client_fault=False) from exc


def _parse(url: str) -> httpx.URL:
    try:
        target = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ImageFetchError(
            f"{url[:200]!r} is not a valid URL ({exc})", client_fault=True
        ) from exc
    if target.scheme not in _DEFAULT_PORTS:
        raise ImageFetchError(
            f"{url[:200]!r} is not fetched: only http and https URLs are", client_fault=True
        )
    host = target.raw_host.decode("ascii", errors="replace")
    if not host:
        raise ImageFetchError(f"{url[:200]!r} has no host", client_fault=True)
    malformation = _malformation(host)
    if malformation is not None:
        raise ImageFetchError(
            f"{url[:200]!r} is not fetched: its host is not a valid name or address: "
            f"{malformation}",
            client_fault=True,
        )
    if target.port is not None and not 0 < target.port < 2**16:
        raise ImageFetchError(
            f"{url[:200]!r} is not fetched: port {target.port} is outside 1-65535",
            client_fault=True,
        )
    return target


def _malformation(host: str) -> str | None:
    """What makes ``host`` (an ASCII URL host) neither an address nor a DNS name, or None."""
    if ":" in host:  # an IPv6 literal, which httpx has checked
        return "an IPv6 zone index is not accepted" if "%" in host else None
    name = host.removesuffix(".")
    if len(name) > _MAX_NAME:
        return f"it has {len(name)} characters, a name at most {_MAX_NAME}"
    for label in name.split("."):
        reason = _label_malformation(label)
        if reason is not None:
            return reason
    return None


def _label_malformation(label: str) -> str | None:
    """What makes ``label`` no DNS label (1-63 letters, digits, '-' or '_'), or None."""
    if not label:
        return "it has an empty label"
    if len(label) > _MAX_LABEL:
        return f"the label {label[:16]!r}... has {len(label)} characters, a label at most 63"
    if not _LABEL.fullmatch(label):
        return f"the label {label!r} holds characters other than letters, digits, '-' and '_'"
    if label.startswith("xn--") and not _is_a_label(label):
        return f"the label {label!r} is not valid punycode (IDNA)"
    return None


def _is_a_label(label: str) -> bool:
    """Whether an ``xn--`` label decodes to printable non-ASCII text that encodes back to it."""
    encoded = label[4:].encode("ascii")
    try:
        text = encoded.decode("punycode")
    except UnicodeError:
        return False
    return not text.isascii() and text.isprintable() and text.encode("punycode") == encoded


def _read(url: str, response: httpx.Response, max_bytes: int, deadline: float) -> Fetched:
    if response.status_code != 200:
        raise ImageFetchError(f"{url} answered HTTP {response.status_code}", client_fault=False)
    media_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if not media_type.startswith("image/"):
        raise ImageFetchError(
            f"{url} is not an image (content type {media_type or 'missing'!r})", client_fault=True
        )
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(url, max_bytes)
    body = bytearray()
    try:
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > max_bytes:
                raise _too_large(url, max_bytes)
            _left(deadline)
    except httpx.TimeoutException as exc:
        raise ImageFetchError(f"{url} timed out", client_fault=False, timed_out=True) from exc
    except httpx.HTTPError as exc:
        raise ImageFetchError(f"{url} could not be read ({exc})", client_fault=False) from exc
    return Fetched(bytes(body), media_type)


def _too_large(url: str, max_bytes: int) -> ImageFetchError:
    return ImageFetchError(
        f"{url} is larger than the {max_bytes} bytes the request's images have left "
        "(--max-image-bytes)",
        client_fault=True,
    )


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise ImageFetchError("fetching timed out", client_fault=False, timed_out=True)
    return left


def _timeout(left: float) -> dict[str, float]:
    return {"connect": min(CONNECT_TIMEOUT_S, left), "read": left, "write": left, "pool": left}
