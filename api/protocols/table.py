"""The protocol table: every generation route is one row, and errors take a row's shape."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from api.protocols import chat_completions, completions, messages, responses
from api.protocols.base import Protocol

PROTOCOLS: tuple[Protocol, ...] = (
    chat_completions.PROTOCOL,
    completions.PROTOCOL,
    responses.PROTOCOL,
    messages.PROTOCOL,
)
# Routes outside the table answer errors like the protocol whose path they extend;
# anything else (models, tokenize, unknown paths) answers like OpenAI.
DEFAULT_ERROR_SHAPE = chat_completions.PROTOCOL
BY_PATH: dict[str, Protocol] = {protocol.path: protocol for protocol in PROTOCOLS}


def route_path(scope: Mapping[str, Any]) -> str:
    """The path the app routes: the request's, without the root path a proxy serves it under
    (``sluice serve --root-path``)."""
    return scope["path"].removeprefix(scope.get("root_path", ""))


def error_shape(path: str) -> Protocol:
    """The protocol whose path ``path`` is or extends (the longest such path)."""
    owners = [p for p in PROTOCOLS if path == p.path or path.startswith(p.path + "/")]
    return max(owners, key=lambda p: len(p.path), default=DEFAULT_ERROR_SHAPE)
