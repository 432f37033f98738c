"""While Redis is down, the routes that read it answer 503 with Retry-After, and recover after.

The real API process runs in distributed mode against a Redis of this module's
own, with no worker: stored responses, jobs, files and batches live in Redis,
so none needs one. With Redis stopped every such route must say "retry later"
in the protocol's error shape (never a 500 and never a reset connection), and
once Redis is back the same process answers as before.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import OpenAI

from tests.distributed.conftest import Api, RedisServer

pytestmark = pytest.mark.distributed

ROUTES = [
    ("GET", "/v1/responses/resp_0123456789abcdef01234567"),
    ("GET", "/v1/responses/resp_0123456789abcdef01234567?stream=true"),
    ("DELETE", "/v1/responses/resp_0123456789abcdef01234567"),
    ("GET", "/v1/jobs/job_0123456789abcdef01234567"),
    ("GET", "/v1/jobs"),
    ("GET", "/v1/files"),
    ("GET", "/v1/files/file-0123456789abcdef01234567"),
    ("GET", "/v1/batches"),
    ("GET", "/v1/messages/batches"),
]


@pytest.fixture(scope="module")
def api(own_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    api = Api(own_redis, tmp_path_factory.mktemp("store-down-api"))
    try:
        yield api.ensure()
    finally:
        api.stop()


def test_store_routes_say_retry_later_while_redis_is_down(api: str, own_redis: RedisServer):
    client = OpenAI(base_url=f"{api}/v1", api_key="sk-local", max_retries=0, timeout=30)
    kept = client.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    own_redis.kill()
    try:
        with httpx.Client(base_url=api, timeout=30) as http:
            for method, path in ROUTES:
                answer = http.request(method, path)
                assert answer.status_code == 503, (path, answer.text)
                assert int(answer.headers["retry-after"]) >= 1
                error = answer.json().get("error")  # OpenAI's shape, or Anthropic's around it
                assert error is not None and "retry" in str(error).lower(), (path, answer.text)
            assert http.get("/health").status_code == 200
    finally:
        own_redis.start()
    assert client.files.list().data == []  # the same process answers again (Redis kept nothing)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(kept.id)
