"""Cancellation: stop generating for a client that is gone, within one engine step.

The API sets ``cancel_flag(id)`` and publishes the id on ``CANCEL_CHANNEL``.
A job that starts later sees the flag (the task checks it); a job already
running hears the channel, here. Pub/sub drops what is published while the
subscriber is disconnected (redis-py may reconnect and resubscribe on its
own, unseen), so the flags of the requests running here are also read after
each subscription and every few seconds: a cancel sent during an outage is
honoured late rather than never.

The same read stops the requests whose origin, the API process their client
is connected to, has died (its ``keys.api_process`` key expired): that
process can no longer cancel them, and nobody will read what they generate.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

import redis

from shared import keys

log = logging.getLogger(__name__)

RETRY_DELAY_S = 1.0
CATCH_UP_INTERVAL_S = 5.0
SUBSCRIBE_TIMEOUT_S = 5.0


class CancellationWatcher:
    """A thread that forwards cancelled request ids to ``cancel``.

    ``running`` maps the request ids this worker runs to their origins, for
    the catch-up read; ``cancel`` must accept ids this worker does not run
    (every worker hears every cancel) and must not block.
    """

    def __init__(
        self,
        client: redis.Redis,
        cancel: Callable[[str], None],
        running: Callable[[], Mapping[str, str | None]],
    ) -> None:
        self._client = client
        self._cancel = cancel
        self._running = running
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sluice-cancel", daemon=True)
        self.subscribed = threading.Event()  # set while subscribed (tests wait on it)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self._stopping.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._listen()
            except redis.RedisError as exc:
                log.warning("cancel channel lost (%s); resubscribing in %.0f s", exc, RETRY_DELAY_S)
            except Exception:  # a dead thread would leave this worker deaf to cancels for good
                log.exception("the cancel listener failed; resubscribing in %.0f s", RETRY_DELAY_S)
            finally:
                self.subscribed.clear()
            self._stopping.wait(RETRY_DELAY_S)

    def _listen(self) -> None:
        with self._client.pubsub() as pubsub:
            pubsub.subscribe(keys.CANCEL_CHANNEL)
            self._await_confirmation(pubsub)
            self.subscribed.set()
            next_catch_up = 0.0
            while not self._stopping.is_set():
                if time.monotonic() >= next_catch_up:
                    self._catch_up()
                    next_catch_up = time.monotonic() + CATCH_UP_INTERVAL_S
                message = pubsub.get_message(timeout=1.0)
                if message is not None and message["type"] == "message":
                    self._cancel(_text(message["data"]))

    @staticmethod
    def _await_confirmation(pubsub: redis.client.PubSub) -> None:
        """Until the server confirms, a cancel published now would not reach us."""
        deadline = time.monotonic() + SUBSCRIBE_TIMEOUT_S
        while time.monotonic() < deadline:
            message = pubsub.get_message(timeout=deadline - time.monotonic())
            if message is not None and message["type"] == "subscribe":
                return
        raise redis.TimeoutError(f"no confirmation of SUBSCRIBE {keys.CANCEL_CHANNEL}")

    def _catch_up(self) -> None:
        """Cancel running requests whose flag was set unheard, or whose origin is gone."""
        running = dict(self._running())
        if not running:
            return
        origins = sorted({origin for origin in running.values() if origin is not None})
        pipe = self._client.pipeline(transaction=False)
        pipe.mget([keys.cancel_flag(request_id) for request_id in running])
        for origin in origins:
            pipe.exists(keys.api_process(origin))
        flags, *present = pipe.execute()
        gone = {origin for origin, alive in zip(origins, present, strict=True) if not alive}
        for (request_id, origin), flag in zip(running.items(), flags, strict=True):
            if origin in gone:
                log.info("cancelling %s: its API process %s is gone", request_id, origin)
            if flag is not None or origin in gone:
                self._cancel(request_id)


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
