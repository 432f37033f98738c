"""What one API process spends on images at once: image tokens running, pixels decoding.

A request's image tokens are the vision encoder's work (each tile costs the
encoder far more than its tokens cost the text model), so a burst of image
requests is bounded by them rather than by the request count alone. The
tokens an image takes follow from its width and height, which the header
gives, so preparation reserves them before decoding a pixel and the
reservation is held until the request ends: past the budget, a 503 to retry
later; a request whose images alone exceed it could never run, and that is
the client's to change, a 400.

Decoding is the one step of preparation whose memory grows with what an
image inflates to rather than with the request body. Each image reserves
what it holds decoded (its header says) from the process's decoding budget
and gives it back once digested; past it, a preparation waits for others to
finish, then is a 503, so a burst of huge images is decoded a few at a time.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

from api.errors import bad_request, overloaded
from api.preparation_pool import DEFAULT_PREPARE_TIMEOUT_S
from shared.events import InferenceEvent

DEFAULT_IMAGE_TOKEN_BUDGET = 65_536  # about 60 photos of SmolVLM-256M's 1,088 tokens
# One 50-megapixel colour picture decoded (200 MB; --max-image-pixels' default), or four
# bilevel ones.
DEFAULT_DECODING_BYTES = 256 * 2**20


class ImageTokenBudget:
    """The image tokens the requests of one process hold at once; thread-safe (preparation
    threads reserve, the event loop and the garbage collector give back)."""

    def __init__(self, limit: int = DEFAULT_IMAGE_TOKEN_BUDGET) -> None:
        self.limit = limit
        self._used = 0
        self._lock = threading.RLock()  # a collected reservation may give back while held

    @property
    def used(self) -> int:
        return self._used

    def reserve(self, tokens: int) -> ImageTokens:
        """``tokens`` held until the reservation is released; an ``ApiError`` instead: 400 when
        they exceed the whole budget, 503 while other requests hold too much of it."""
        self._take(tokens, tokens)
        return ImageTokens(self, tokens)

    def _take(self, tokens: int, total: int) -> None:
        """``tokens`` more for a request whose images then take ``total``; ``reserve``'s errors."""
        if total > self.limit:
            raise bad_request(
                f"the request's images take {total} image tokens, more than the server's "
                f"budget of {self.limit} (--image-token-budget); send fewer or smaller images",
                "messages",
                "limit_exceeded",
            )
        with self._lock:
            fits = self._used + tokens <= self.limit
            if fits:
                self._used += tokens
        if not fits:
            raise overloaded(
                f"the server's image token budget ({self.limit}, --image-token-budget) is in "
                "use by other requests; retry later"
            )

    def _give_back(self, tokens: int) -> None:
        with self._lock:
            self._used -= tokens


class ImageTokens:
    """Tokens reserved from an ``ImageTokenBudget``, given back exactly once: by ``release``,
    when the events ``held_during`` wraps end, or when the reservation is collected unreleased
    (a prepared request dropped before it ran)."""

    def __init__(self, budget: ImageTokenBudget, tokens: int) -> None:
        self._budget = budget
        self._held = [tokens]  # shared with the finalizer, which must not hold ``self``
        self._finalizer = weakref.finalize(self, _give_back, budget, self._held)

    @property
    def tokens(self) -> int:
        return self._held[0]

    def settle(self, tokens: int) -> None:
        """Hold exactly ``tokens`` (the images' count, once they are decoded): what is over is
        given back, what is missing taken, with ``reserve``'s errors."""
        held = self._held[0]
        if tokens > held:
            self._budget._take(tokens - held, tokens)
        else:
            self._budget._give_back(held - tokens)
        self._held[0] = tokens

    def release(self) -> None:
        """Give the tokens back; later calls do nothing."""
        self._finalizer()

    async def held_during(
        self, events: AsyncIterator[InferenceEvent]
    ) -> AsyncIterator[InferenceEvent]:
        """``events``, with the tokens given back once they end or are closed."""
        try:
            async for event in events:
                yield event
        finally:
            self.release()


def _give_back(budget: ImageTokenBudget, held: list[int]) -> None:
    budget._give_back(held[0])
    held[0] = 0


@contextmanager
def released_on_error(tokens: ImageTokens | None) -> Iterator[None]:
    """Gives ``tokens`` back if the block raises: a request that fails to prepare holds none."""
    try:
        yield
    except BaseException:
        if tokens is not None:
            tokens.release()
        raise


class DecodingBudget:
    """The bytes of decoded images one process's preparations hold at once; thread-safe.

    An image larger than the whole budget is decoded alone, once nothing else is.
    """

    def __init__(
        self, limit: int = DEFAULT_DECODING_BYTES, wait_s: float = DEFAULT_PREPARE_TIMEOUT_S
    ) -> None:
        self.limit = limit
        self.wait_s = wait_s  # the longest a preparation waits for room: its own deadline
        self._used = 0
        self._freed = threading.Condition()

    @property
    def used(self) -> int:
        return self._used

    @contextmanager
    def holding(self, size: int, deadline: float) -> Iterator[None]:
        """``size`` bytes held for the block, once they fit; a 503 if they do not by
        ``deadline`` (``time.monotonic()``)."""
        size = min(size, self.limit)
        with self._freed:
            fits = self._freed.wait_for(
                lambda: self._used + size <= self.limit, max(0.0, deadline - time.monotonic())
            )
            if not fits:
                raise overloaded(
                    f"Decoding the image needs {size} bytes; other requests hold {self._used} "
                    f"of the server's {self.limit} for decoding images; retry shortly."
                )
            self._used += size
        try:
            yield
        finally:
            with self._freed:
                self._used -= size
                self._freed.notify_all()
