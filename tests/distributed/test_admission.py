"""Admission and the queue deadline, through the official SDKs, with no worker needed.

The API here serves ``orphan``, a second registry name for the default
weights whose queue no worker consumes, with a 2 s queue timeout and room for
one request in flight. A ghost worker (a registry entry with no consumer
behind it) stands in for a worker where admission needs to see one. The
documented answers:

- no live worker for the model, even after waiting the queue timeout: 503;
- a worker is live but nobody starts the job by its queue deadline: 503;
- queued + in flight at the bound: 429 (``rate_limit_exceeded`` /
  ``rate_limit_error``);

all with ``Retry-After``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import anthropic
import openai
import pytest

from shared import keys
from shared.registry import smollm2_gguf_path
from tests.distributed.conftest import Api, Fleet, GhostWorker, RedisServer, wait_until

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MODEL = "orphan"
QUEUE_TIMEOUT_S = 2
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture
def orphan_api(api_process: Api, fleet: Fleet, redis_server: RedisServer, tmp_path: Path) -> str:
    """The API for ``orphan`` (``fleet`` only so that the workers start loading now)."""
    config = tmp_path.parent / "orphan.toml"
    config.write_text(
        f'[models.{MODEL}]\nweights = "{smollm2_gguf_path()}"\n'
        'prompt_format = "chatml"\ncontext_length = 1024\n'
    )
    base_url = api_process.ensure(
        "--config", str(config), "--model", MODEL,
        "--queue-timeout", str(QUEUE_TIMEOUT_S), "--max-inflight", "1",
    )  # fmt: skip
    ghost(redis_server).leave()
    redis_server.client.delete(keys.inflight(MODEL))
    return base_url


def ghost(server: RedisServer) -> GhostWorker:
    return GhostWorker(server.client, "ghost", MODEL)


def ghost_worker(server: RedisServer) -> None:
    """A worker for ``orphan`` that no consumer stands behind."""
    ghost(server).beat(ttl_s=30, capacity=1, max_model_len=1024)


def clients(base_url: str) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    return (
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-local", max_retries=0, timeout=30),
        anthropic.Anthropic(base_url=base_url, api_key="sk-local", max_retries=0, timeout=30),
    )


def test_no_worker_for_the_model_is_a_503_after_the_queue_timeout(orphan_api: str):
    chat, _ = clients(orphan_api)
    began = time.monotonic()
    with pytest.raises(openai.InternalServerError) as refused:
        chat.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    waited = time.monotonic() - began
    assert refused.value.status_code == 503
    assert refused.value.response.headers["retry-after"]
    assert refused.value.body["type"] == "overloaded_error"
    assert "No worker is serving this model" in refused.value.body["message"]
    assert QUEUE_TIMEOUT_S <= waited < QUEUE_TIMEOUT_S + 2


def test_a_job_nobody_starts_by_its_queue_deadline_is_a_503(
    orphan_api: str, redis_server: RedisServer
):
    ghost_worker(redis_server)
    chat, messages = clients(orphan_api)
    with pytest.raises(openai.InternalServerError) as whole:
        chat.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    with pytest.raises(openai.InternalServerError) as streamed:
        chat.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=True)
    with pytest.raises(anthropic.InternalServerError) as anthropic_refused:
        messages.messages.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    for refused in (whole.value, streamed.value, anthropic_refused.value):
        assert refused.status_code == 503
        assert int(refused.response.headers["retry-after"]) > 0
    assert "No worker started the request" in whole.value.body["message"]
    assert anthropic_refused.value.body["error"]["type"] == "overloaded_error"


def test_overload_is_refused_with_429(orphan_api: str, redis_server: RedisServer):
    ghost_worker(redis_server)
    chat, messages = clients(orphan_api)

    def occupy() -> None:  # queued until its deadline, holding the only place
        with pytest.raises(openai.InternalServerError):
            chat.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)

    holder = threading.Thread(target=occupy)
    holder.start()
    wait_until(lambda: redis_server.client.zcard(keys.inflight(MODEL)), 5, "the first request")
    with pytest.raises(openai.RateLimitError) as openai_refused:
        chat.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    with pytest.raises(anthropic.RateLimitError) as anthropic_refused:
        messages.messages.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    holder.join()

    assert openai_refused.value.code == "rate_limit_exceeded"
    assert openai_refused.value.response.headers["retry-after"] == "1"
    assert anthropic_refused.value.body["error"]["type"] == "rate_limit_error"
    assert anthropic_refused.value.response.headers["retry-after"] == "1"
