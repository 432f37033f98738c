"""Slow, stalled and oversized clients against a real ``sluice serve``, over raw sockets.

Headers that do not arrive in time get a 408 and headers past the size limit a
431, both before any route runs; a body left unfinished (chunked or not) gets
the body deadline's 408; an idle kept-alive connection is closed. A hundred
such clients at once do not delay a normal request. The same server (one
sequence at a time) shows the first-token deadline firing for a request queued
behind a long one, and the server's memory after bodies at the size limit.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.servers import rss_mib, running_server, server_pid

pytestmark = pytest.mark.slow

HEADER_TIMEOUT_S = 2
BODY_TIMEOUT_S = 2
KEEP_ALIVE_S = 2
FIRST_TOKEN_TIMEOUT_S = 3
LONG_TOKENS = 960  # holds the only sequence past the first-token deadline on any machine
MAX_HEADER_BYTES = 16 * 1024
MAX_BODY_BYTES = 8 * 2**20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = [
        "--max-model-len", "1024", "--max-num-seqs", "1",
        "--header-timeout", str(HEADER_TIMEOUT_S), "--max-header-bytes", str(MAX_HEADER_BYTES),
        "--body-timeout", str(BODY_TIMEOUT_S), "--keep-alive-timeout", str(KEEP_ALIVE_S),
        "--first-token-timeout", str(FIRST_TOKEN_TIMEOUT_S), "--queue-timeout", "60",
        "--max-body-bytes", str(MAX_BODY_BYTES),
    ]  # fmt: skip
    with running_server(args, tmp_path_factory.mktemp("connections")) as base_url:
        yield base_url


def _address(server: str) -> tuple[str, int]:
    host, port = server.removeprefix("http://").split(":")
    return host, int(port)


def _chat(max_tokens: int, **extra: object) -> dict:
    messages = [{"role": "user", "content": "Tell me a long story."}]
    return {"model": "default", "messages": messages, "max_tokens": max_tokens, **extra}


NOT_BEHIND_S = HEADER_TIMEOUT_S - 0.5
"""How much longer than alone a normal request may take beside stalled clients: one held
until they time out would take longer (it starts 0.3 s after them). A bound on the
difference, not on the time, holds on a slow machine too."""


async def _timed_chat(server: str) -> tuple[int, float]:
    """A two-token chat request's status and seconds."""
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=server, timeout=60) as client:
        reply = await client.post("/v1/chat/completions", json=_chat(2))
    return reply.status_code, time.monotonic() - started


async def _send_and_wait(server: str, data: bytes, wait_s: float = 30) -> tuple[bytes, float]:
    """Write ``data`` and read what the server answers before it closes (or ``wait_s`` passes)."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection(*_address(server))
    writer.write(data)
    await writer.drain()
    answer = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), wait_s):
            answer += chunk
    finally:
        writer.close()
    return answer, time.monotonic() - started


def test_a_hundred_slow_header_clients_get_408_and_do_not_delay_a_normal_request(server: str):
    partial = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "

    async def scene() -> tuple[list[tuple[bytes, float]], tuple[bytes, float], int, float]:
        _, alone_s = await _timed_chat(server)
        slow = [asyncio.create_task(_send_and_wait(server, partial)) for _ in range(100)]
        silent = asyncio.create_task(_send_and_wait(server, b""))
        await asyncio.sleep(0.3)
        status, normal_s = await _timed_chat(server)
        return await asyncio.gather(*slow), await silent, status, normal_s - alone_s

    slow, silent, normal_status, delay_s = asyncio.run(scene())
    assert normal_status == 200 and delay_s < NOT_BEHIND_S
    for answer, seconds in slow:
        assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
        assert b"did not arrive within 2s" in answer
        assert HEADER_TIMEOUT_S - 0.5 <= seconds < HEADER_TIMEOUT_S + 5
    answer, seconds = silent  # a connection that sends nothing is closed without an answer
    assert answer == b"" and seconds < HEADER_TIMEOUT_S + 5


def test_headers_past_the_limit_are_a_431_whether_whole_or_endless(server: str):
    big = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (2 * MAX_HEADER_BYTES)
    answer, _ = asyncio.run(_send_and_wait(server, big + b"\r\n\r\n"))
    assert answer.startswith(b"HTTP/1.1 431"), answer[:80]
    assert f"exceed {MAX_HEADER_BYTES} bytes".encode() in answer

    async def endless() -> bytes:
        """A header that never ends: the server answers and closes after the limit."""
        reader, writer = await asyncio.open_connection(*_address(server))
        answer = asyncio.create_task(reader.read(4096))  # read while still writing, as clients do
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        try:
            for _ in range(50 * 16):  # up to 50 MiB, 64 KiB at a time, until answered
                writer.write(b"b" * 65536)
                await writer.drain()
                await asyncio.sleep(0)  # the reader runs even when drain need not wait
                if answer.done():
                    break
        except (ConnectionError, OSError):
            pass  # the server closed the connection
        writer.close()
        return await asyncio.wait_for(answer, 10)

    assert asyncio.run(endless()).startswith(b"HTTP/1.1 431")
    within = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Fine: " + b"c" * (MAX_HEADER_BYTES // 2)
    assert asyncio.run(_send_and_wait(server, within + b"\r\nConnection: close\r\n\r\n"))[
        0
    ].startswith(b"HTTP/1.1 200")


def test_an_unfinished_chunked_body_gets_the_body_deadlines_408(server: str):
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    answer, seconds = asyncio.run(_send_and_wait(server, head + b'10\r\n{"model": "defau'))
    assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
    assert BODY_TIMEOUT_S - 0.5 <= seconds < BODY_TIMEOUT_S + 5


def test_an_idle_kept_alive_connection_is_closed(server: str):
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    answer, seconds = asyncio.run(_send_and_wait(server, request))
    assert answer.startswith(b"HTTP/1.1 200") and b'"ok"' in answer
    assert KEEP_ALIVE_S - 0.5 <= seconds < KEEP_ALIVE_S + 5  # closed by the server, idle


def test_the_first_token_deadline_fires_for_a_request_queued_behind_a_long_one(server: str):
    """The long request streams on after the queued one's 504; it is closed then, which frees
    the only sequence for the next request."""

    async def scene() -> tuple[int, int, tuple[httpx.Response, float]]:
        async with httpx.AsyncClient(base_url=server, timeout=120) as client:

            async def send_queued() -> tuple[httpx.Response, float]:
                started = time.monotonic()
                answer = await client.post("/v1/chat/completions", json=_chat(4))
                return answer, time.monotonic() - started

            body = _chat(LONG_TOKENS, ignore_eos=True, stream=True)
            async with client.stream("POST", "/v1/chat/completions", json=body) as long:
                chunks = aiter(long.aiter_lines())
                while '"content"' not in await anext(chunks):
                    pass  # the long one holds the only sequence
                queued = asyncio.create_task(send_queued())
                before = after = 0  # chunks while the queued one waits, then five more
                while after < 5:
                    if '"content"' in await anext(chunks):
                        before, after = (before, after + 1) if queued.done() else (before + 1, 0)
                return before, after, await queued

    before, after, (queued, waited) = asyncio.run(scene())
    assert queued.status_code == 504, queued.text
    assert queued.json()["error"]["type"] == "timeout_error"
    assert f"No first token within {FIRST_TOKEN_TIMEOUT_S}s" in queued.text
    assert FIRST_TOKEN_TIMEOUT_S - 1.5 <= waited < FIRST_TOKEN_TIMEOUT_S + 10
    assert before > 0 and after == 5  # the long one streamed through the deadline and on
    following = httpx.post(f"{server}/v1/chat/completions", json=_chat(2), timeout=60)
    assert following.status_code == 200  # both left the engine: nothing is ahead


def test_bodies_at_the_size_limit_cost_no_lasting_memory(server: str, capsys):
    """A body of exactly the limit is read and refused (too long a prompt), at no lasting cost."""
    pid = server_pid(server)
    before = rss_mib(pid)
    padding = MAX_BODY_BYTES - len(json.dumps(_chat(4, messages=[]))) - 100
    body = _chat(4)
    body["messages"] = [{"role": "user", "content": "x" * padding}]
    payload = json.dumps(body).encode()
    payload += b" " * (MAX_BODY_BYTES - len(payload))  # exactly at the limit
    after: list[float | None] = []
    for _ in range(3):
        answer = httpx.post(
            f"{server}/v1/chat/completions",
            content=payload,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert answer.status_code == 400 and "context" in answer.text, answer.text[:200]
        after.append(rss_mib(pid))
    over = httpx.post(
        f"{server}/v1/chat/completions",
        content=payload + b" ",
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert over.status_code == 413
    if before is None or None in after:
        pytest.skip("the server's process was not found to read its memory")
    with capsys.disabled():
        rounds = ", ".join(f"{mib:.0f}" for mib in after)  # type: ignore[str-format]
        print(f"\nserver RSS {before:.0f} MiB; after each of 3 bodies of 8 MiB: {rounds} MiB")
    assert after[2] - after[0] < 32  # no growth per body
    assert after[2] - before < 8 * MAX_BODY_BYTES / 2**20  # a bounded margin, freed after
