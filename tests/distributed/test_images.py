"""An image request on workers: the embedded engine's output, and exact across a ``kill -9``.

Two workers and an API serve a random-weight Idefics3 checkpoint
(``bench.vision_model``) under the name ``seer``. The image crosses Redis as
its encoded bytes inside the prepared request; each worker decodes and
preprocesses it again, so a survivor that resumes a stream re-encodes the
image and continues with no lost or repeated token.
"""

from __future__ import annotations

import base64
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from openai import OpenAI

from api.backends.base import ServedModel
from api.preparation import PreparationContext, prepare
from api.protocols import chat_completions
from bench.vision_model import make_idefics3
from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from shared import keys
from shared.event_codec import decode_entry
from shared.events import Text
from shared.images.loading import load_image_processing
from shared.registry import ModelRegistry, ModelSpec
from shared.tokenizer_loader import load_tokenizer
from tests.distributed.conftest import (
    API_OPTIONS,
    STARTUP_TIMEOUT_S,
    Api,
    Child,
    RedisServer,
    live_reports,
    wait_until,
)
from tests.image_server import png_bytes

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MODEL = "seer"
MAX_MODEL_LEN = 1024
MAX_TOKENS = 400


@dataclass
class VisionFleet:
    base_url: str
    spec: ModelSpec
    workers: dict[str, Child]
    redis: RedisServer


@pytest.fixture(scope="module")
def vision_fleet(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VisionFleet]:
    directory = tmp_path_factory.mktemp("seer")
    weights = make_idefics3(directory / "weights")
    config = directory / "models.toml"
    config.write_text(f'[models.{MODEL}]\nweights = "{weights}"\ncapabilities = ["images"]\n')
    model = ["--config", str(config), "--model", MODEL, "--max-model-len", str(MAX_MODEL_LEN)]
    workers = {
        worker_id: Child.spawn(
            [
                sys.executable,
                "-m",
                "workers.main",
                "--redis",
                redis_server.url,
                *model,
                "--worker-id",
                worker_id,
                "--max-num-seqs",
                "4",
            ],
            directory / f"{worker_id}.log",
        )  # fmt: skip
        for worker_id in ("seer-1", "seer-2")
    }
    api = Api(redis_server, directory)
    try:
        base_url = api.ensure(*model, *API_OPTIONS)
        wait_until(
            lambda: len(live_reports(redis_server.client, MODEL)) == 2,
            STARTUP_TIMEOUT_S,
            "both vision workers",
            interval=0.2,
        )
        yield VisionFleet(base_url, ModelSpec(MODEL, weights), workers, redis_server)
    finally:
        api.stop()
        for child in workers.values():
            child.stop(signal.SIGKILL, timeout=10)


def body(color: tuple[int, int, int]) -> dict:
    url = "data:image/png;base64," + base64.b64encode(png_bytes(40, 30, color)).decode()
    content = [
        {"type": "text", "text": "Tell me everything about this picture."},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }


def embedded_text(spec: ModelSpec, request: dict) -> str:
    """What the embedded engine answers: the API's preparation, then the engine in process."""
    weights = spec.weights
    served = ServedModel(
        spec, load_tokenizer(weights), MAX_MODEL_LEN, load_image_processing(weights)
    )
    context = PreparationContext(ModelRegistry([spec]), {MODEL: served})
    wire = prepare(chat_completions.PROTOCOL, request, context).wire
    engine = LLMEngine(
        EngineArgs(model=str(weights), max_model_len=MAX_MODEL_LEN, num_kv_blocks=128)
    )
    engine.add_request("reference", wire.prompt_token_ids, wire.sampling, images=wire.images)
    text = ""
    while engine.has_unfinished():
        text += "".join(event.text for event in engine.step() if isinstance(event, Text))
    return text


def client(fleet: VisionFleet) -> OpenAI:
    return OpenAI(base_url=f"{fleet.base_url}/v1", api_key="sk-local", max_retries=0)


def sdk_options(request: dict) -> dict:
    options = {key: value for key, value in request.items() if key != "ignore_eos"}
    return {**options, "extra_body": {"ignore_eos": True}}


def test_an_image_request_on_workers_answers_as_embedded(vision_fleet: VisionFleet):
    request = body((30, 160, 90))
    completion = client(vision_fleet).chat.completions.create(**sdk_options(request))
    assert completion.choices[0].message.content == embedded_text(vision_fleet.spec, request)
    assert completion.usage is not None and completion.usage.completion_tokens == MAX_TOKENS


def test_a_killed_worker_s_image_stream_resumes_exactly(vision_fleet: VisionFleet):
    request = body((200, 40, 40))
    expected = embedded_text(vision_fleet.spec, request)
    stream = client(vision_fleet).chat.completions.create(**sdk_options(request), stream=True)
    text, request_id, killed = "", "", False
    for chunk in stream:
        request_id = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            if not killed:
                kill_serving_worker(vision_fleet)
                killed = True
    entries = [
        decode_entry(request_id, fields)
        for _, fields in vision_fleet.redis.client.xrange(keys.event_stream(request_id))
    ]
    assert max(entry.attempt for entry in entries) >= 2, "the stream was not resumed"
    assert text == expected


def kill_serving_worker(fleet: VisionFleet) -> None:
    """``kill -9`` the worker holding a taken job, the moment its first text arrives."""
    client = fleet.redis.client
    serving = [
        worker_id
        for worker_id, child in fleet.workers.items()
        if child.alive and client.hlen(keys.taken(worker_id))
    ]
    assert len(serving) == 1, f"serving workers: {serving}"
    victim = fleet.workers[serving[0]]
    os.kill(victim.process.pid, signal.SIGKILL)
    victim.process.wait()
