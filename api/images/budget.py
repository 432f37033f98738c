"""The image tokens one API process runs at once: past the budget, a 503 to retry later.

A request's image tokens are the vision encoder's work (each tile costs the
encoder far more than its tokens cost the text model), so a burst of image
requests is bounded by them rather than by the request count alone. The
budget is held from the request's start to its end, per process; a request
with no image passes through untouched. A request whose images alone exceed
the budget could never run: that is the client's to change, a 400.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from shared.events import Error, InferenceEvent
from shared.wire import PreparedRequest

DEFAULT_IMAGE_TOKEN_BUDGET = 65_536  # about 60 photos of SmolVLM-256M's 1,088 tokens


class ImageTokenBudget:
    def __init__(self, limit: int = DEFAULT_IMAGE_TOKEN_BUDGET) -> None:
        self.limit = limit
        self.used = 0

    async def hold(
        self, request: PreparedRequest, events: AsyncIterator[InferenceEvent]
    ) -> AsyncIterator[InferenceEvent]:
        """``events``, with the request's image tokens held until they end; or one ``Error``."""
        tokens = sum(image.end - image.start for image in request.images)
        refusal = self._refusal(request.request_id, tokens)
        if refusal is not None:
            yield refusal
            return
        self.used += tokens
        try:
            async for event in events:
                yield event
        finally:
            self.used -= tokens

    def _refusal(self, request_id: str, tokens: int) -> Error | None:
        if tokens > self.limit:
            return Error(
                request_id,
                f"the request's images take {tokens} image tokens, more than the server's "
                f"budget of {self.limit} (--image-token-budget); send fewer or smaller images",
                "invalid_request",
            )
        if self.used + tokens > self.limit:
            return Error(
                request_id,
                f"the server's image token budget ({self.limit}, --image-token-budget) is in "
                f"use by other requests; retry later",
                "overloaded",
            )
        return None
