"""A response whose client stops taking it ends, and the app's generation is closed."""

from __future__ import annotations

import asyncio

from api.stall_guard import StallGuard


def test_a_chunk_the_client_never_takes_ends_the_response():
    closed = asyncio.Event()

    async def streaming_app(scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for _ in range(100):
                await send({"type": "http.response.body", "body": b"x", "more_body": True})
        finally:
            closed.set()  # the generation's events would be closed here

    sent: list[dict] = []

    async def client_that_stops_reading(message: dict) -> None:
        sent.append(message)
        if len(sent) > 3:
            await asyncio.sleep(3600)  # the buffers are full: send waits

    async def run() -> float:
        guard = StallGuard(streaming_app, timeout_s=0.2)
        loop = asyncio.get_running_loop()
        started = loop.time()
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions"}
        await asyncio.wait_for(guard(scope, None, client_that_stops_reading), 5)
        return loop.time() - started

    elapsed = asyncio.run(run())
    assert closed.is_set() and len(sent) == 4
    assert 0.2 <= elapsed < 2
