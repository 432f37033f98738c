"""The Anthropic Messages protocol (``POST /v1/messages``) as one row of the table.

Parsing lives in ``messages_request`` (wire models in ``messages_schema``), the
event stream and final ``Message`` in ``messages_response``. This module joins
them and adds the token counting endpoint, which shares the request body
(minus ``max_tokens`` and ``stream``) and whose count the server computes.
"""

from __future__ import annotations

from api.protocols.base import Protocol
from api.protocols.messages_request import parse, parse_count_tokens
from api.protocols.messages_response import MessagesResponseBuilder, error_body
from api.protocols.messages_schema import CreateBody

COUNT_TOKENS_PATH = "/v1/messages/count_tokens"

PROTOCOL = Protocol(
    name="messages",
    path="/v1/messages",
    id_prefix="msg_",
    parse=parse,
    builder=MessagesResponseBuilder,
    error_body=error_body,
    request_model=CreateBody,
    anthropic_rate_limit_headers=True,
)


def count_tokens_body(input_tokens: int) -> dict[str, int]:
    """The ``count_tokens`` answer: every prompt token, cached or not, counts."""
    return {"input_tokens": input_tokens}


__all__ = [
    "COUNT_TOKENS_PATH",
    "PROTOCOL",
    "MessagesResponseBuilder",
    "count_tokens_body",
    "error_body",
    "parse",
    "parse_count_tokens",
]
