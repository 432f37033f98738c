"""Images: preparation time, the vision encoder's share of TTFT, and what crosses Redis.

    python -m bench.vision [--repeat 20] [--redis redis://127.0.0.1:6379/0] [--no-engine]

On a random-weight Idefics3 with SmolVLM-256M's shapes (``bench.vision_model``;
no real weights are on this machine, and the cost does not depend on them):

- **Preparation** (also in ``python -m bench.prepare``): p50 of ``prepare`` on a
  chat with one 1024x1024 JPEG, base64 and fetched from a local HTTP server,
  beside the same chat without the image.
- **TTFT**: one request with the image on the engine, its time to first
  token and the encoder's part of it, beside a text-only prompt of the same
  length.
- **Transport**: the image as encoded bytes in the prepared request (what
  crosses) against its preprocessed tiles as float32 and bfloat16 tensors:
  size, a Redis SET + GET of each, and what the worker then spends decoding
  and preprocessing the bytes again.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from api.backends.base import ServedModel
from api.images.destinations import DestinationPolicy
from api.images.resolution import ImageOptions
from api.preparation import PreparationContext, prepare
from api.protocols.chat_completions import PROTOCOL
from bench.vision_model import make_idefics3
from shared.images.decoding import decode_image
from shared.images.loading import load_image_processing
from shared.registry import ModelRegistry, ModelSpec
from shared.tokenizer_loader import load_tokenizer

SHAPE = "smolvlm-256m"
MODEL = "smolvlm"
SIDE = 1024
QUESTION = "Describe this photograph in detail."


def photo(side: int = SIDE, seed: int = 0) -> bytes:
    """A photograph-like JPEG: smooth shapes and fine grain, so it compresses like one."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((side, side), Image.Resampling.BICUBIC))
    grain = rng.normal(0, 12, (side, side, 3))
    pixels = np.clip(smooth + grain, 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


@contextmanager
def serving(image: bytes) -> Iterator[str]:
    """``image`` as ``http://127.0.0.1:PORT/photo.jpg``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the standard library's name
            self.send_response(200)
            self.send_header("Content-Type", "image/jpeg")
            self.send_header("Content-Length", str(len(image)))
            self.end_headers()
            self.wfile.write(image)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/photo.jpg"
    finally:
        server.shutdown()
        server.server_close()


def chat(url: str | None) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": QUESTION}]
    if url is not None:
        content.append({"type": "image_url", "image_url": {"url": url}})
    return {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": content}]}


def vision_context(weights: Path) -> PreparationContext:
    """What ``sluice serve --image-allow 127.0.0.1`` prepares with, for the checkpoint."""
    spec = ModelSpec(MODEL, weights, capabilities=["images"])
    served = ServedModel(spec, load_tokenizer(weights), 8192, load_image_processing(weights))
    policy = DestinationPolicy.allowing(["127.0.0.1"])
    return PreparationContext(ModelRegistry([spec]), {MODEL: served}, ImageOptions(policy))


def p50_ms(function: Callable[[], Any], repeat: int) -> float:
    function()  # warm-up
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def preparation(repeat: int) -> str:
    """p50 ``prepare`` of the chat without an image, with it inline, and fetched."""
    image = photo()
    with tempfile.TemporaryDirectory() as tmp, serving(image) as url:
        context = vision_context(make_idefics3(Path(tmp), SHAPE, weights=False))
        inline = "data:image/jpeg;base64," + base64.b64encode(image).decode()
        cases = {"text only": chat(None), "JPEG, base64": chat(inline), "JPEG, fetched": chat(url)}
        rows = []
        for name, body in cases.items():
            tokens = len(prepare(PROTOCOL, body, context).wire.prompt_token_ids)
            p50 = p50_ms(lambda body=body: prepare(PROTOCOL, body, context), repeat)
            rows.append((name, p50, tokens))
    baseline = rows[0][1]
    lines = [
        f"Preparation, {SIDE}x{SIDE} JPEG ({len(image) / 1e3:.0f} kB), SmolVLM-256M's "
        f"processing, p50 of {repeat}:",
        f"{'request':<14}  {'p50 ms':>8}  {'÷ text':>7}  {'prompt tokens':>13}",
    ]
    lines += [f"{n:<14}  {p:>8.2f}  {p / baseline:>7.1f}  {t:>13}" for n, p, t in rows]
    return "\n".join(lines)


def time_to_first_token(dtype: str) -> str:
    """TTFT of one image request and of a text prompt as long, with the encoder's part."""
    import torch

    from engine.config import EngineArgs
    from engine.llm_engine import LLMEngine
    from shared.events import Text
    from shared.sampling import SamplingParams

    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        weights = make_idefics3(Path(tmp), SHAPE)
        wire = prepare(PROTOCOL, chat(_data_url(photo())), vision_context(weights)).wire
        engine = LLMEngine(
            EngineArgs(model=str(weights), dtype=dtype, max_model_len=4096, log_stats=False)
        )
    model = engine.runner.model
    encoding: list[float] = []
    encode = model.encode_images

    def timed_encode(pixels: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        features = encode(pixels)
        encoding.append(time.perf_counter() - start)
        return features

    model.encode_images = timed_encode  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def first_token(name: str, ids: list[int], images: Any = ()) -> float:
        start = time.perf_counter()
        engine.add_request(name, ids, params, images=images)
        while engine.has_unfinished():
            if any(isinstance(event, Text) for event in engine.step()):
                break
        elapsed = time.perf_counter() - start
        while engine.has_unfinished():
            engine.step()
        return elapsed

    ids = wire.prompt_token_ids
    first_token("warm-up", ids[-64:])
    text_ids = [ids[i % 64] for i in range(len(ids))]  # as long, no image
    text_s = first_token("text", text_ids)
    image_s = first_token("image", ids, wire.images)
    return "\n".join(
        [
            f"TTFT on the engine, SmolVLM-256M's shapes, {dtype}, one request, "
            f"{len(ids)} prompt tokens ({sum(i.end - i.start for i in wire.images)} of the image):",
            f"  text only, as long     {text_s:8.2f} s",
            f"  one {SIDE}x{SIDE} JPEG    {image_s:8.2f} s   (÷ text {image_s / text_s:.1f})",
            f"  of which the encoder   {encoding[0]:8.2f} s   "
            f"({encoding[0] / image_s:.0%} of TTFT)",
        ]
    )


def transport(redis_url: str | None, repeat: int) -> str:
    """The image as bytes in the prepared request, or as tiles: size, Redis, the worker's work."""
    image = photo()
    with tempfile.TemporaryDirectory() as tmp:
        weights = make_idefics3(Path(tmp), SHAPE, weights=False)
        processing = load_image_processing(weights)
        wire = prepare(PROTOCOL, chat(_data_url(image)), vision_context(weights)).wire
    assert processing is not None
    payload = json.dumps(wire.to_dict()).encode()
    tiles = processing.preprocess(decode_image(image, 2**28)).pixel_values
    float32 = tiles.tobytes()
    bfloat16 = (tiles.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # truncated: size only
    worker_ms = p50_ms(lambda: processing.preprocess(decode_image(image, 2**28)), repeat)
    redis = _redis(redis_url)
    lines = [
        f"What crosses Redis for one {SIDE}x{SIDE} JPEG ({tiles.shape[0]} tiles of "
        f"{tiles.shape[2]}x{tiles.shape[3]}), p50 of {repeat}:",
        f"{'payload':<34}  {'bytes':>12}  {'SET+GET ms':>10}",
    ]
    for name, data in (
        ("prepared request, image as bytes", payload),
        ("tiles, float32", float32),
        ("tiles, bfloat16", bfloat16),
    ):
        seconds = "-" if redis is None else f"{_round_trip(redis, data, repeat):.2f}"
        lines.append(f"{name:<34}  {len(data):>12,}  {seconds:>10}")
    lines.append(f"the worker decodes and preprocesses the bytes again: {worker_ms:.1f} ms p50")
    return "\n".join(lines)


def _data_url(image: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(image).decode()


def _redis(url: str | None) -> Any:
    if url is None:
        return None
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.RedisError:
        return None
    return client


def _round_trip(client: Any, data: bytes, repeat: int) -> float:
    key = "sluice:bench:vision"

    def set_get() -> None:
        client.set(key, data)
        client.get(key)

    try:
        return p50_ms(set_get, repeat)
    finally:
        client.delete(key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20, help="timed runs per figure")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="for SET + GET")
    parser.add_argument("--dtype", default="float32", help="the engine's dtype for TTFT")
    parser.add_argument("--no-engine", action="store_true", help="skip the TTFT run")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # as `sluice serve` runs
    print(preparation(args.repeat), end="\n\n")
    print(transport(args.redis, args.repeat), end="\n\n")
    if not args.no_engine:
        print(time_to_first_token(args.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
