"""API keys: who may call the API, under which name, with which priority and models.

Keys come from ``--api-key`` (repeatable), ``SLUICE_API_KEY``, or a TOML file
of named keys stored as SHA-256 hashes (``--api-keys``)::

    [keys.alice]
    sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    priority = -1            # optional: lower runs first (the engine's order)
    models = ["default"]     # optional: the models this key may use
    requests_per_minute = 60 # optional limits (api/rate_limits.py)
    tokens_per_minute = 100000
    max_concurrent = 4

A client sends its key as ``Authorization: Bearer <key>`` (the openai SDK) or
``x-api-key: <key>`` (the anthropic SDK). Keys are compared as SHA-256 digests
in constant time and never logged; a key is known by its name (a plain key's
name is ``key-`` and the start of its digest), which is also what owns its
async jobs. ``/health``, ``/ready``, ``/version`` and the playground's static page stay
open (the page's calls carry the key its user types); ``/metrics`` is open unless
``--metrics-token`` is set, and then needs that token as a bearer.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import ApiError
from api.protocols.table import error_shape, route_path
from api.rate_limits import KeyLimits

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/ready", "/version", "/"})
OPEN_PREFIXES = ("/playground/",)  # static files: api/playground
METRICS_PATH = "/metrics"
_LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")
_KEY_FIELDS = frozenset({"sha256", "priority", "models", *_LIMIT_FIELDS})
_HEX = frozenset("0123456789abcdef")


class KeyFileError(ValueError):
    """A keys file that cannot be used; the message names the key and the field."""


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One accepted key: its name, its digest, its default priority and allowed models."""

    name: str
    digest: bytes
    priority: int = 0
    models: frozenset[str] | None = None  # None: every model
    limits: KeyLimits = KeyLimits()

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


class KeyRing:
    """The accepted keys; empty means the API is open to anyone who can reach it."""

    def __init__(self, keys: Iterable[ApiKey] = ()) -> None:
        self.keys = tuple(keys)
        names = [key.name for key in self.keys]
        if len(set(names)) != len(names):
            raise KeyFileError("two API keys have the same name")

    @classmethod
    def configured(cls, plain: Iterable[str], keys_file: Path | None) -> KeyRing:
        """Plain keys (flags, environment) and the named keys of ``keys_file``."""
        keys = [plain_key(key) for key in dict.fromkeys(plain) if key]
        if keys_file is not None:
            keys += read_keys_file(keys_file)
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def find(self, presented: str) -> ApiKey | None:
        """The key whose digest matches, compared in constant time against every key."""
        digest = hashlib.sha256(presented.encode("utf-8", "surrogatepass")).digest()
        found = None
        for key in self.keys:
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found

    def named(self, name: str | None) -> ApiKey | None:
        """The key called ``name`` (what records keep of their owner)."""
        return next((key for key in self.keys if key.name == name), None)

    def describe(self) -> str:
        """For the start log line: whether keys are required, and how many."""
        if not self.enabled:
            return "no API key configured: every client that reaches the port is served"
        return f"{len(self.keys)} API key(s) configured: requests without one get 401"


def read_keys_file(path: Path) -> list[ApiKey]:
    """Named keys from a TOML file (``[keys.<name>]`` tables); ``KeyFileError`` names the fault."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise KeyFileError(f"API keys file {path}: {exc}") from None
    tables = data.get("keys")
    if not isinstance(tables, dict) or not tables:
        raise KeyFileError(f"API keys file {path}: expected [keys.<name>] tables")
    return [_named_key(path, name, entry) for name, entry in tables.items()]


def _named_key(path: Path, name: str, entry: Any) -> ApiKey:
    where = f"API keys file {path}: key {name!r}"
    if not isinstance(entry, dict):
        raise KeyFileError(f"{where} must be a table")
    unknown = set(entry) - _KEY_FIELDS
    if unknown:
        raise KeyFileError(
            f"{where}: unsupported field(s) {', '.join(sorted(unknown))}; "
            f"supported: {', '.join(sorted(_KEY_FIELDS))}"
        )
    digest = entry.get("sha256")
    if not isinstance(digest, str) or len(digest) != 64 or not set(digest.lower()) <= _HEX:
        raise KeyFileError(f"{where}: sha256 must be the key's SHA-256 as 64 hex digits")
    priority = entry.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise KeyFileError(f"{where}: priority must be an integer, got {priority!r}")
    models = entry.get("models")
    if models is not None and (
        not isinstance(models, list) or not all(isinstance(m, str) and m for m in models)
    ):
        raise KeyFileError(f"{where}: models must be a list of model names")
    limits = {}
    for field in _LIMIT_FIELDS:
        value = entry.get(field)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise KeyFileError(f"{where}: {field} must be a positive integer, got {value!r}")
        limits[field] = value
    return ApiKey(
        name,
        bytes.fromhex(digest),
        priority,
        frozenset(models) if models is not None else None,
        KeyLimits(**limits),
    )


def plain_key(key: str) -> ApiKey:
    digest = hashlib.sha256(key.encode()).digest()
    return ApiKey("key-" + digest.hex()[:12], digest)


def presented_key(headers: Headers) -> str | None:
    """The key a client sent: ``Authorization: Bearer <key>``, else ``x-api-key``."""
    authorization = headers.get("authorization", "")
    scheme, _, credentials = authorization.partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    return headers.get("x-api-key") or None


class Authentication:
    """ASGI middleware: a request without an accepted key gets 401 before any route runs.

    The accepted key is left in ``scope["state"]["api_key"]`` (its name, which
    routes read as ``request.state.api_key``) and ``["api_key_record"]``.
    """

    def __init__(self, app: ASGIApp, keys: KeyRing, metrics_token: str | None = None) -> None:
        self.app = app
        self.keys = keys
        self._metrics_digest = (
            hashlib.sha256(metrics_token.encode()).digest() if metrics_token else None
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = route_path(scope) if scope["type"] == "http" else ""
        if scope["type"] != "http" or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            await self.app(scope, receive, send)
            return
        presented = presented_key(Headers(scope=scope))
        if path == METRICS_PATH:
            if self._metrics_digest is None or _matches(presented, self._metrics_digest):
                await self.app(scope, receive, send)
                return
            await _refuse(scope, receive, send, "the metrics token is missing or wrong")
            return
        if not self.keys.enabled:
            await self.app(scope, receive, send)
            return
        key = self.keys.find(presented) if presented is not None else None
        if key is None:
            message = (
                "Incorrect API key provided."
                if presented is not None
                else "Missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key'."
            )
            await _refuse(scope, receive, send, message)
            return
        state = scope.setdefault("state", {})
        state["api_key"] = key.name
        state["api_key_record"] = key
        await self.app(scope, receive, send)


def _matches(presented: str | None, digest: bytes) -> bool:
    if presented is None:
        return False
    return hmac.compare_digest(hashlib.sha256(presented.encode()).digest(), digest)


async def _refuse(scope: Scope, receive: Receive, send: Send, message: str) -> None:
    """401 in the shape of the protocol the path belongs to; the SDKs raise AuthenticationError."""
    error = ApiError(401, message, "authentication_error", None, "invalid_api_key")
    body = error_shape(route_path(scope)).error_body(error)
    await JSONResponse(body, status_code=401)(scope, receive, send)


def caller_key(request: Request) -> ApiKey | None:
    """The caller's API key (its limits, models and priority); None when keys are off."""
    return getattr(request.state, "api_key_record", None)


def caller_name(request: Request) -> str | None:
    """The caller's key name: what jobs, files, batches and stored responses belong to.

    None while keys are off: then everything is everyone's.
    """
    return getattr(request.state, "api_key", None)
