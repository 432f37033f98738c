"""Several models behind one distributed API: each request goes to its model's worker pool.

The suite's two workers serve the default model; a third serves a tiny model
(random weights, real architecture) from the same registry file. The API
serves both, and the official SDK chooses by ``model``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from tests.distributed.conftest import (
    API_OPTIONS,
    Api,
    Child,
    Fleet,
    live_reports,
    wait_until,
)
from tests.e2e.test_several_models import several_models_options

pytestmark = pytest.mark.distributed
TINY = "tiny-llama"


@pytest.fixture(scope="module")
def options(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return several_models_options(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def tiny_worker(fleet: Fleet, options: list[str]) -> Iterator[Child]:
    command = [
        sys.executable, "-m", "workers.main", "--redis", fleet.redis.url,
        options[0], options[1], "--model", "tiny", "--worker-id", "tiny-1",
        "--max-num-seqs", "2", "--enforce-eager", "--loglevel", "WARNING",
    ]  # fmt: skip
    child = Child.spawn(command, fleet.log_dir / "tiny-1.log")
    try:
        yield child
    finally:
        child.stop()


def test_each_model_runs_on_its_own_pool(
    api_process: Api, fleet: Fleet, tiny_worker: Child, options: list[str]
) -> None:
    base_url = api_process.ensure(*API_OPTIONS, *options)
    fleet.top_up()
    fleet.wait_live()
    wait_until(
        lambda: "tiny-1" in live_reports(fleet.redis.client, TINY) or not tiny_worker.alive,
        120,
        "the tiny model's worker",
    )
    assert tiny_worker.alive, tiny_worker.log()
    listed = {model["id"] for model in httpx.get(f"{base_url}/v1/models").json()["data"]}
    assert listed == {"smollm2-135m-instruct", TINY}

    client = OpenAI(base_url=f"{base_url}/v1", api_key="sk-local", max_retries=0, timeout=120)
    before = _generated(fleet)
    for model in ("default", "tiny"):
        completion = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert completion.usage is not None and completion.usage.completion_tokens == 6

    def reported() -> dict[str, int] | None:  # the pools report their totals every beat
        after = _generated(fleet)
        return after if all(after[model] >= before[model] + 6 for model in after) else None

    after = wait_until(reported, 10, "both pools' reports")
    assert after[TINY] - before[TINY] == 6  # the tiny pool ran the tiny request only


def _generated(fleet: Fleet) -> dict[str, int]:
    """Tokens each model's live workers report having generated."""
    return {
        model: sum(
            report["generated_tokens"]
            for report in live_reports(fleet.redis.client, model).values()
        )
        for model in ("smollm2-135m-instruct", TINY)
    }
