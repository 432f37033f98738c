"""Errors in each protocol's own shape, and a gone client costing no more engine time."""

from __future__ import annotations

import re
import time

import anthropic
import httpx
import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import CONTEXT

MODEL = "default"
SERVED = "smollm2-135m-instruct"  # the name "default" resolves to: the metrics' model_name
MESSAGES = [{"role": "user", "content": "Write a long story about a dragon who learns to fly."}]
UNKNOWN_MODEL_MESSAGE = (
    "The supported API model names are default, smollm2-135m-instruct, but you passed nope."
)

pytestmark = pytest.mark.slow


def test_unknown_model_openai(openai_client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=1)
    error = raised.value.body
    assert error["message"] == UNKNOWN_MODEL_MESSAGE
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client.responses.create(model="nope", input="hi", max_output_tokens=16)
    assert raised.value.body["message"] == UNKNOWN_MODEL_MESSAGE


def test_unknown_model_anthropic(anthropic_client: anthropic.Anthropic):
    with pytest.raises(anthropic.BadRequestError) as raised:
        anthropic_client.messages.create(model="nope", messages=MESSAGES, max_tokens=1)
    assert raised.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": UNKNOWN_MODEL_MESSAGE},
    }


def test_context_overflow_message(http: httpx.Client, openai_client: openai.OpenAI):
    prompt = http.post("/v1/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    tokens = prompt["count"]
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=CONTEXT)
    assert raised.value.body["message"] == (
        f"This model's maximum context length is {CONTEXT} tokens. However, you requested "
        f"{tokens + CONTEXT} tokens ({tokens} in the messages, {CONTEXT} in the completion). "
        "Please reduce the length of the messages or completion."
    )
    assert raised.value.body["param"] == "max_tokens"


def test_bad_temperature(openai_client: openai.OpenAI, anthropic_client: anthropic.Anthropic):
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1, temperature=7
        )
    assert raised.value.body["param"] == "temperature"
    assert "temperature" in raised.value.body["message"]
    with pytest.raises(anthropic.BadRequestError) as raised:
        anthropic_client.messages.create(
            model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={"temperature": 7}
        )
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in raised.value.body["error"]["message"]


@pytest.mark.parametrize(
    ("path", "shape"),
    [
        ("/v1/chat/completions", "openai"),
        ("/v1/responses", "openai"),
        ("/v1/messages", "anthropic"),
    ],
)
def test_malformed_json_and_wrong_content_type(http: httpx.Client, path: str, shape: str):
    broken = http.post(path, content=b'{"model": ', headers={"content-type": "application/json"})
    form = http.post(path, content=b"model=default", headers={"content-type": "text/plain"})
    array = http.post(path, json=[1, 2])
    for response in (broken, form, array):
        assert response.status_code == 400
        body = response.json()
        if shape == "openai":
            assert body["error"]["type"] == "invalid_request_error"
        else:
            assert body["type"] == "error"
            assert body["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in _message(broken.json())
    assert "Content-Type" in _message(form.json())


def test_messages_requires_max_tokens(http: httpx.Client):
    response = http.post("/v1/messages", json={"model": MODEL, "messages": MESSAGES})
    assert response.status_code == 400
    body = response.json()
    assert body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]


def test_unknown_route_and_method(http: httpx.Client):
    missing = http.post("/v1/nothing", json={})
    assert missing.status_code == 404 and "error" in missing.json()
    wrong_method = http.get("/v1/messages")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["type"] == "error"


def test_health_ready_and_metrics(http: httpx.Client, openai_client: OpenAI):
    """After one known request, vLLM's series moved by what that request did."""
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/ready").status_code == 200
    before = samples(http)
    reply = openai_client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
        temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    after = samples(http)

    def moved(name: str, **labels: str) -> float:
        key = (name, frozenset({"model_name": SERVED, **labels}.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    usage = reply.usage
    assert moved("vllm:prompt_tokens_total") == usage.prompt_tokens
    assert moved("vllm:generation_tokens_total") == usage.completion_tokens == 5
    assert moved("vllm:prefix_cache_queries_total") == usage.prompt_tokens
    cached = usage.prompt_tokens_details.cached_tokens
    assert moved("vllm:prefix_cache_hits_total") == cached
    assert moved("vllm:request_success_total", finished_reason="length") == 1
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert moved(f"vllm:{name}_seconds_count") == 1, name
    assert moved("vllm:inter_token_latency_seconds_count") == 4
    assert ("vllm:num_preemptions_total", frozenset({"model_name": SERVED}.items())) in after
    assert engine_gauges(after) == (0, 0, 0)  # cached blocks no request holds count as free
    stream = openai_client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=500, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    with stream:
        next(iter(stream))
        running, waiting, usage = engine_gauges(samples(http))
    assert (running, waiting) == (1, 0) and 0 < usage < 1
    deadline = time.monotonic() + 20
    while engine_gauges(samples(http)) != (
        0,
        0,
        0,
    ):  # the closed stream's abort, for the tests after
        assert time.monotonic() < deadline, "the closed stream was not aborted"
        time.sleep(0.05)


def engine_gauges(values: dict[tuple[str, frozenset], float]) -> tuple[float, ...]:
    """vLLM's running, waiting and KV cache usage gauges for the served model."""
    labels = frozenset({"model_name": SERVED}.items())
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    return tuple(values[(name, labels)] for name in names)


def samples(http: httpx.Client) -> dict[tuple[str, frozenset], float]:
    """Every sample of ``/metrics``, by name and labels."""
    text = http.get("/metrics").text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# --- a client that leaves ------------------------------------------------------------


def _metric(http: httpx.Client, name: str) -> float:
    text = http.get("/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def _wait_for_abort(http: httpx.Client, aborted_before: float) -> None:
    deadline = time.monotonic() + 20
    while _metric(http, "sluice_engine_aborted_requests_total") < aborted_before + 1:
        assert time.monotonic() < deadline, "the engine did not abort the request"
        time.sleep(0.05)


def _assert_engine_idle(http: httpx.Client, tokens_before: float, budget: int) -> None:
    """Nothing runs, nothing more is generated, and far less than the budget was spent."""
    assert _metric(http, f'vllm:num_requests_running{{model_name="{SERVED}"}}') == 0
    generated = _metric(http, "sluice_engine_generated_tokens_total")
    time.sleep(0.5)
    assert _metric(http, "sluice_engine_generated_tokens_total") == generated
    assert generated - tokens_before < budget // 2


def test_closing_a_stream_aborts_the_request(http: httpx.Client, server: str):
    aborted = _metric(http, "sluice_engine_aborted_requests_total")
    tokens = _metric(http, "sluice_engine_generated_tokens_total")
    budget = 1000
    body = {**_long_generation(budget), "stream": True}
    client = httpx.Client(base_url=server, timeout=60)
    with client, client.stream("POST", "/v1/chat/completions", json=body) as response:
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                break
    # leaving both blocks closed the connection mid-stream
    _wait_for_abort(http, aborted)
    _assert_engine_idle(http, tokens, budget)


def test_a_whole_response_whose_client_left_is_aborted(http: httpx.Client, server: str):
    aborted = _metric(http, "sluice_engine_aborted_requests_total")
    tokens = _metric(http, "sluice_engine_generated_tokens_total")
    budget = 1900  # seconds of decoding, within the context: the client waits 1.5 s of it
    body = _long_generation(budget)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/chat/completions", json=body, timeout=1.5)
    _wait_for_abort(http, aborted)
    _assert_engine_idle(http, tokens, budget)


def _long_generation(max_tokens: int) -> dict:
    """A request that greedily runs to its budget (this prompt never ends early)."""
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0}


def _message(body: dict) -> str:
    return body["error"]["message"]
