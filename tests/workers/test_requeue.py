"""A handed-back job goes first in line, ahead of the jobs queued since."""

from __future__ import annotations

import base64
import json
import time

import pytest
import redis
from celery.exceptions import Reject

from shared import keys
from shared.sampling import SamplingParams
from shared.task_message import priority_list, task_message
from shared.wire import Deadlines, PreparedRequest, QueuedRequest, decode_queued
from tests.servers import free_port
from workers.task import requeue_first

MODEL = "requeue-test"


def job(request_id: str, priority: int = 0) -> QueuedRequest:
    request = PreparedRequest(
        request_id, MODEL, [1, 2], SamplingParams(max_tokens=2), priority=priority
    )
    return QueuedRequest(request, Deadlines(queue=time.time() + 30))


def request_id_of(raw: str) -> str:
    body = json.loads(base64.b64decode(json.loads(raw)["body"]))
    return decode_queued(body[0][0]).request.request_id


@pytest.mark.parametrize("priority", [0, 7])
def test_a_handed_back_job_is_taken_before_those_queued_since(
    client: redis.Redis, priority: int
) -> None:
    for request_id in ("waiting-1", "waiting-2"):  # queued the way the API queues
        message = task_message(job(request_id, priority))
        client.lpush(message.key, message.body)

    record = (keys.taken("requeue-worker"), "tag-1")
    client.hset(*record, "what the take script wrote")

    requeue_first(client, job("handed-back", priority), "handed_back", record)

    assert not client.hexists(*record)  # gone with the push: a lost ack cannot restore it

    queue = priority_list(keys.queue_name(MODEL), priority)
    taken = []
    while (item := client.brpop([queue], timeout=1)) is not None:  # as kombu's consumer does
        taken.append(request_id_of(item[1].decode()))
    assert taken == ["handed-back", "waiting-1", "waiting-2"]


def test_without_redis_the_job_is_rejected_for_celery_to_requeue() -> None:
    unreachable = redis.Redis(port=free_port(), socket_connect_timeout=1)
    with pytest.raises(Reject) as raised:
        requeue_first(unreachable, job("lost"), "unpublished", (keys.taken("w"), "tag"))
    assert raised.value.requeue is True
    assert "unpublished" in str(raised.value.reason)
