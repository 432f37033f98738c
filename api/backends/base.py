"""The narrow interface between the HTTP layer and whatever runs the model.

A backend takes a ``PreparedRequest`` (token ids, sampling, parsing options)
and yields ``InferenceEvent``s; it never sees a protocol. The embedded
backend runs the engine in this process; a queue-based backend (Redis,
Celery) implements the same few methods, so the routes do not change.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from shared.events import InferenceEvent
from shared.generation_config import NO_DEFAULTS, SamplingDefaults
from shared.images.layout import ImageProcessing
from shared.registry import ModelSpec
from shared.tokenizer_loader import LoadedTokenizer
from shared.wire import PreparedRequest

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from api.rate_limits import RateLimitTicket


class Place:
    """A request's place among those a backend admitted; ``release`` gives it back, once.

    The default holds no place: a backend that bounds its work elsewhere (the
    distributed one, in Redis) hands these out.
    """

    def release(self) -> None:
        """Give the place back; idempotent."""


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A model a backend can run, with what preparation needs to encode for it.

    ``context_length`` is the limit the engine enforces (prompt + completion),
    which may be below the registry's figure when the KV cache is smaller.
    """

    spec: ModelSpec
    tokenizer: LoadedTokenizer
    context_length: int
    image_processing: ImageProcessing | None = None  # a vision model's; it sees images
    sampling_defaults: SamplingDefaults = NO_DEFAULTS  # its generation_config.json's

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template prompts are rendered with: the entry's, else the tokenizer's."""
        return self.spec.chat_template or self.tokenizer.chat_template


@dataclass(frozen=True, slots=True)
class BackendHealth:
    """A snapshot for ``/ready`` and ``/metrics``; counters are totals since start."""

    ready: bool
    detail: str = ""
    failed: bool = False  # it can serve no more (the model failed to load, the engine died)
    aborted: int = 0  # requests the engine stopped early (client gone, shutdown)
    steps: int = 0
    generated_tokens: int = 0


class Backend(Protocol):
    """Runs prepared requests: every capability the API calls, with no-op defaults.

    ``infer`` is an async generator. It ends after a ``Finish`` or ``Error``
    event; closing it before that (``aclose()``, or cancellation while it
    waits) cancels the request, so the model stops working for a client that
    is gone. ``models`` is meaningful once ``health().ready`` is true.
    Backends subclass this class to inherit the defaults.
    """

    # Whether ``infer`` takes a key's share of its rate limits (its ``ticket``) as it admits
    # the request, in the same round trip; otherwise the share is taken before and ``infer``
    # is called with the request alone.
    takes_shares: bool = False

    def infer(
        self, request: PreparedRequest, ticket: RateLimitTicket | None = None
    ) -> AsyncIterator[InferenceEvent]: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def health(self) -> BackendHealth: ...

    def models(self) -> list[ServedModel]: ...

    async def admit(self, model: str | None = None) -> Place:
        """Refuse a request for ``model`` (the name it asks for, if any) before its
        preparation (a 429/503 ``ApiError``), or admit it.

        The caller releases the admission when the request has ended. Default:
        admit, holding no place.
        """
        return Place()

    async def failure(self) -> str:
        """Wait until the backend can serve no more, and say why. Default: it never fails."""
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    def metrics_collector(self) -> Collector | None:
        """Gauges of this backend's own for ``/metrics``; default: none."""
        return None
