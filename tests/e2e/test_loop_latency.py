"""The event loop keeps answering while the heaviest requests a client may send are handled.

One vision server (a random-weight Idefics3 checkpoint, ``bench.vision_model``)
receives, all at once: a chat request whose body is just under the 32 MiB a
body may hold, an Anthropic message batch of 100,000 requests (cancelled once
created), and eight chat requests each carrying a 7000x7000 1-bit PNG of a
few kilobytes. Meanwhile a poller calls ``/health`` one request after
another: its 99th percentile must stay under 200 ms. Each heavy request must
be answered, with no 5xx other than a 503 that says when to retry.

The bound separates a loop blocked by a heavy request (parsing the batch's
body alone takes about 430 ms here) from the scheduling delay of a 2-core
machine that the suite's other process shares: 58-65 ms alone, up to 134 ms
beside the rest of the suite.
"""

from __future__ import annotations

import base64
import io
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from PIL import Image, ImageDraw

from bench.vision_model import vision_model_options
from tests.servers import running_server

pytestmark = pytest.mark.slow

P99_BOUND_S = 0.200
MAX_BODY_BYTES = 32 * 2**20
BATCH_REQUESTS = 100_000
IMAGES = 8
SIDE = 7000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("loop")
    args = [*vision_model_options(directory), "--max-model-len", "2048", "--max-num-seqs", "4"]
    with running_server(args, directory) as base_url:
        yield base_url


def huge_chat() -> bytes:
    """A chat body a few KiB under the body limit: one long user message."""
    head = {"model": "seer", "max_tokens": 1, "messages": [{"role": "user", "content": ""}]}
    room = MAX_BODY_BYTES - len(json.dumps(head)) - 4096
    return json.dumps({**head, "messages": [{"role": "user", "content": "word " * (room // 5)}]})


def message_batch() -> bytes:
    params = {"model": "seer", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    requests = [{"custom_id": f"r{n}", "params": params} for n in range(BATCH_REQUESTS)]
    return json.dumps({"requests": requests}).encode()


def bilevel_png() -> bytes:
    """A 7000x7000 1-bit picture that compresses to a few kilobytes."""
    image = Image.new("1", (SIDE, SIDE), 1)
    ImageDraw.Draw(image).rectangle((SIDE // 4, SIDE // 4, SIDE // 2, SIDE // 2), fill=0)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()


def image_chat(picture: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(picture).decode()
    image = {"type": "image_url", "image_url": {"url": url}}
    parts = [{"type": "text", "text": "What is it?"}, image]
    return {"model": "seer", "max_tokens": 1, "messages": [{"role": "user", "content": parts}]}


POLLER = """
import json, sys, threading, time
import httpx
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
latencies = []
with httpx.Client(base_url=sys.argv[1], timeout=10) as client:
    print("ready", flush=True)
    while not stop.is_set():
        started = time.perf_counter()
        try:
            ok = client.get("/health").status_code == 200
        except httpx.HTTPError:  # no answer within the client's 10 s
            ok = False
        latencies.append(time.perf_counter() - started if ok else float("inf"))
        time.sleep(0.01)
print(json.dumps([min(x, 1e9) for x in latencies]), flush=True)
"""


class Poller:
    """A process of its own that calls ``/health`` back to back, noting how long each answer
    took, from ``with`` to its end: the test's threads sending heavy bodies cannot delay it."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.latencies: list[float] = []

    def __enter__(self) -> Poller:
        command = [sys.executable, "-c", POLLER, self.base_url]
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._process.stdout is not None
        assert self._process.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *exc: object) -> None:
        out, _ = self._process.communicate("stop\n", timeout=30)
        self.latencies = json.loads(out)

    def p99(self) -> float:
        return statistics.quantiles(self.latencies, n=100)[98]


def post(server: str, path: str, content: bytes) -> httpx.Response:
    with httpx.Client(base_url=server, timeout=300) as client:
        return client.post(path, content=content, headers={"Content-Type": "application/json"})


def test_health_answers_within_200_ms_while_heavy_requests_are_handled(server: str):
    chat, batch, picture = huge_chat().encode(), message_batch(), bilevel_png()
    assert len(chat) < MAX_BODY_BYTES and len(picture) < 64 * 1024
    image_body = json.dumps(image_chat(picture)).encode()
    # Warm: what a first request of each kind loads (an image decoder, a batch's machinery)
    # is loaded before the poller starts.
    small = json.dumps({"requests": json.loads(message_batch())["requests"][:1]}).encode()
    assert post(server, "/v1/messages/batches", small).status_code == 200
    assert post(server, "/v1/chat/completions", image_body).status_code == 200
    answers: dict[str, httpx.Response] = {}

    def send(name: str, path: str, content: bytes) -> None:
        answers[name] = answer = post(server, path, content)
        if name == "batch" and answer.status_code == 200:  # its lines need not all run
            answers["cancel"] = post(server, f"{path}/{answer.json()['id']}/cancel", b"{}")

    senders = [
        threading.Thread(target=send, args=("chat", "/v1/chat/completions", chat)),
        threading.Thread(target=send, args=("batch", "/v1/messages/batches", batch)),
    ]
    senders += [
        threading.Thread(target=send, args=(f"image{n}", "/v1/chat/completions", image_body))
        for n in range(IMAGES)
    ]
    with Poller(server) as idle:
        time.sleep(2)
    with Poller(server) as poller:
        time.sleep(0.5)
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(timeout=300)
    statuses = {name: answer.status_code for name, answer in answers.items()}
    print(
        f"\n/health while idle: p99 {idle.p99() * 1000:.1f} ms; under the heavy requests: "
        f"{len(poller.latencies)} calls, p50 {statistics.median(poller.latencies) * 1000:.1f} ms,"
        f" p99 {poller.p99() * 1000:.1f} ms, max {max(poller.latencies) * 1000:.0f} ms; "
        f"answers {statuses}"
    )
    assert len(answers) == len(senders) + 1  # the batch's cancel too
    for name, answer in answers.items():
        assert answer.status_code < 500 or (
            answer.status_code == 503 and "retry-after" in answer.headers
        ), (name, answer.status_code, answer.text[:300])
    assert answers["batch"].json()["request_counts"]["processing"] == BATCH_REQUESTS
    assert poller.p99() < P99_BOUND_S
