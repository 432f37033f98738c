"""Fetching an image URL through the destination policy, within a deadline and a size.

Each hop (the URL, then every redirect) is parsed, resolved once, checked and
connected to by the checked address; the original host still goes out as the
``Host`` header and, for https, as the TLS server name the certificate is
verified against. Environment proxies are ignored: a proxy would connect on
the server's behalf to an address nobody checked. The body streams in and
stops at the byte budget; only ``image/*`` content types are read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from api.images.destinations import DestinationPolicy, RefusedDestination, UnresolvableHost

MAX_REDIRECTS = 3
CONNECT_TIMEOUT_S = 5.0
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}


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
    host = target.host
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
    if not target.host:
        raise ImageFetchError(f"{url[:200]!r} has no host", client_fault=True)
    return target


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
