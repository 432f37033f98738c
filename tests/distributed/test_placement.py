"""Placement by prefix and load across three real workers, through the official SDK.

Each conversation starts with a system prompt no other test uses, so only
the worker that ran its first turn caches its blocks: a later turn that
reports them as cached ran there. Which worker holds them is read from the
workers' cache summaries in Redis, the same sets the API places by.
"""

from __future__ import annotations

import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis
from openai import OpenAI

from shared import keys
from shared.prefix_hash import digest, prefix_hashes
from shared.registry import DEFAULT_MODEL
from tests.distributed.conftest import (
    WORKER_SEQS,
    Fleet,
    Greedy,
    RedisServer,
    tokenize,
    wait_until,
)

pytestmark = pytest.mark.distributed

BLOCK = 16  # the workers' KV block size
TURNS = 6
REPLY_TOKENS = 12


@pytest.fixture(scope="module")
def three_workers(fleet: Fleet) -> Iterator[Fleet]:
    """The session's fleet with a third worker for this module; back to two after it."""
    fleet.size = 3
    fleet.top_up()
    fleet.wait_live()
    try:
        yield fleet
    finally:
        fleet.size = 2
        for worker_id, worker in list(fleet.workers.items()):
            if not worker.child.alive:
                del fleet.workers[worker_id]
        for worker_id in list(fleet.workers)[2:]:
            fleet.workers.pop(worker_id).child.stop(signal.SIGTERM, timeout=30)


@pytest.fixture
def client(api: str, three_workers: Fleet) -> OpenAI:
    three_workers.top_up()
    three_workers.wait_live()
    return OpenAI(base_url=f"{api}/v1", api_key="sk-local", max_retries=0, timeout=120)


def system_prompt() -> dict:
    """A system prompt of some 45 blocks that no other conversation shares: a match long enough
    to outweigh the default load cost of the jobs a full worker holds."""
    words = " ".join(f"rule {index}: answer briefly and politely." for index in range(64))
    return {"role": "system", "content": f"Conversation {uuid.uuid4().hex}. {words}"}


def chat(client: OpenAI, messages: list[dict], max_tokens: int = REPLY_TOKENS):
    return client.chat.completions.create(
        model="default", messages=messages, max_tokens=max_tokens, temperature=0
    )


def holders(server: RedisServer, fleet: Fleet, prompt_ids: list[int]) -> set[str]:
    """The workers whose cache summary holds every full block of ``prompt_ids`` but the last."""
    usable = (len(prompt_ids) - 1) // BLOCK * BLOCK
    digests = [digest(h) for h in prefix_hashes(prompt_ids[:usable], BLOCK)]
    client = server.client
    return {
        worker_id
        for worker_id in fleet.workers
        if all(client.smismember(keys.cache_summary(worker_id), digests))
    }


def placements(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    pattern = r'^sluice_placements_total\{model="[^"]+",placement="(\w+)"\} (\S+)$'
    return {kind: float(value) for kind, value in re.findall(pattern, text, re.MULTILINE)}


def warm(client: OpenAI, api: str, server: RedisServer, fleet: Fleet) -> tuple[list[dict], str]:
    """A first turn, run wherever; the conversation so far and the worker that caches it."""
    messages = [system_prompt(), {"role": "user", "content": "Say hello."}]
    reply = chat(client, messages)
    messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    found = wait_until(
        lambda: holders(server, fleet, tokenize(api, messages[:2])), 5, "the summary to show it"
    )
    assert len(found) == 1, found
    return messages, found.pop()


def test_every_later_turn_lands_where_its_prefix_is_cached(
    client: OpenAI, api: str, redis_server: RedisServer, three_workers: Fleet
) -> None:
    messages = [system_prompt()]
    before = placements(api)
    previous_ids: list[int] = []
    holder = None
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"Question {turn}: name a colour."})
        prompt_ids = tokenize(api, messages)
        reply = chat(client, messages)
        cached = reply.usage.prompt_tokens_details.cached_tokens
        assert reply.usage.prompt_tokens == len(prompt_ids)
        if turn > 0:
            assert prompt_ids[: len(previous_ids)] == previous_ids
            assert cached >= len(previous_ids) // BLOCK * BLOCK, (turn, cached, len(previous_ids))
        found = wait_until(
            lambda ids=prompt_ids: holders(redis_server, three_workers, ids), 5, "a holder"
        )
        assert len(found) == 1, f"turn {turn} cached on {found}"
        assert holder is None or found == {holder}, f"turn {turn} moved from {holder} to {found}"
        holder = found.pop()
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        previous_ids = prompt_ids

    after = placements(api)
    assert after["prefix"] - before.get("prefix", 0) >= TURNS - 1


def test_a_saturated_preferred_worker_does_not_hold_a_request_back(
    client: OpenAI, api: str, redis_server: RedisServer, three_workers: Fleet
) -> None:
    """Its slots are all taken by long generations: the next request runs elsewhere at once."""
    messages, holder = warm(client, api, redis_server, three_workers)
    done = threading.Event()
    long_runs: list[threading.Thread] = []

    def long_run(index: int) -> None:
        """A long generation, read until the probe is done; closing the stream cancels it.
        Its budget outlasts the probe at any speed the engine reaches (the context holds it)."""
        asked = [*messages, {"role": "user", "content": f"Count to a thousand, run {index}."}]
        stream = client.chat.completions.create(
            model="default", messages=asked, max_tokens=1000, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        with stream:
            for _ in stream:
                if done.is_set():
                    return

    for index in range(WORKER_SEQS):
        thread = threading.Thread(target=long_run, args=(index,), daemon=True)
        thread.start()
        long_runs.append(thread)
        wait_until(
            lambda index=index: three_workers.heartbeats()[holder]["running"] > index,
            30,
            "the long run to start on the preferred worker",
        )
    before = placements(api)

    began = time.monotonic()
    probe = [*messages, {"role": "user", "content": "Name one colour."}]
    reply = chat(client, probe)
    took = time.monotonic() - began
    still_running = sum(thread.is_alive() for thread in long_runs)
    done.set()

    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens_details.cached_tokens == 0  # not where the prefix is
    assert still_running == WORKER_SEQS, "the long runs ended first"
    assert placements(api)["shared"] - before.get("shared", 0) >= 1
    assert took < 30
    for thread in long_runs:
        thread.join(30)
    wait_until(lambda: not three_workers.heartbeats()[holder]["running"], 30, "the runs stopped")


def test_kill_9_of_a_worker_with_jobs_on_its_own_queue_loses_none(
    client: OpenAI,
    api: str,
    redis_server: RedisServer,
    three_workers: Fleet,
    reference: Greedy,
) -> None:
    """Frozen, it still looks free: jobs are placed on its own queue; killed, others run them.

    The frozen worker's read, blocked in Redis, still takes the jobs pushed
    before it returned (the take script runs server-side): those are held,
    the others wait on its own queue.
    """
    messages, holder = warm(client, api, redis_server, three_workers)
    victim = three_workers.workers[holder]
    own_wake = keys.queue_wake(keys.own_queue(DEFAULT_MODEL, holder))
    asks = [[*messages, {"role": "user", "content": f"Tell me fact {n}."}] for n in range(3)]
    expected = reference.many([tokenize(api, ask) for ask in asks], 24)
    replies: list[str | None] = [None] * len(asks)

    def ask(index: int) -> None:
        replies[index] = chat(client, asks[index], 24).choices[0].message.content

    before = placements(api)
    victim.child.process.send_signal(signal.SIGSTOP)
    try:
        threads = [threading.Thread(target=ask, args=(n,), daemon=True) for n in range(len(asks))]
        for thread in threads:
            thread.start()
        wait_until(
            lambda: placements(api)["prefix"] - before["prefix"] == len(asks), 5, "all placed"
        )
        assert redis_server.client.llen(own_wake) >= 1
    finally:
        victim.child.process.send_signal(signal.SIGKILL)
    victim.child.process.wait(10)
    for thread in threads:
        thread.join(90)

    assert replies == expected
    assert not redis_server.client.exists(own_wake, keys.cache_summary(holder))
    try:
        members = redis_server.client.zrange(keys.workers(DEFAULT_MODEL), 0, -1)
    except redis.RedisError:
        members = []
    assert holder not in members
