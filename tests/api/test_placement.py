"""Placement: the choice between workers and the shared queue, and the read behind it."""

from __future__ import annotations

import time
import uuid

import pytest
from redis.asyncio import Redis

from api.backends.fleet_snapshot import FleetSnapshot
from api.backends.placement import SHARED, Candidate, PlacementPolicy, Placer, choose
from shared import keys
from shared.prefix_hash import digest, prefix_hashes
from shared.wire import WorkerLoad

REDIS_URL = "redis://127.0.0.1:6379/0"
POLICY = PlacementPolicy(load_cost=32, min_match=32)
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def candidate(
    name: str, matched: int, held: int = 0, queued: int = 0, capacity: int = 4, **load: object
) -> Candidate:
    worker = WorkerLoad(name, "m", capacity=capacity, block_size=16, **load)
    return Candidate(worker, matched, held, queued)


def chosen(candidates: list[Candidate]) -> tuple[str, str | None]:
    kind, best = choose(candidates, POLICY)
    return kind, None if best is None else best.load.worker_id


def test_the_longest_match_wins_among_equally_busy_workers() -> None:
    assert chosen([candidate("a", 64), candidate("b", 160), candidate("c", 0)]) == ("prefix", "b")


def test_a_match_below_the_minimum_or_nowhere_goes_to_the_shared_queue() -> None:
    assert chosen([candidate("a", 16), candidate("b", 0)]) == ("shared", None)
    assert chosen([candidate("a", 0), candidate("b", 0)]) == ("shared", None)
    assert chosen([]) == ("shared", None)


def test_a_worker_busier_than_its_cache_is_worth_loses_to_the_shared_queue() -> None:
    """64 cached tokens are worth 2 jobs at 32 tokens each: 3 more jobs than an idle worker
    outweigh them, 1 does not."""
    assert chosen([candidate("a", 64, held=3), candidate("b", 0)]) == ("shared", None)
    assert chosen([candidate("a", 64, held=1), candidate("b", 0)]) == ("prefix", "a")
    assert chosen([candidate("a", 64, held=3), candidate("b", 0, held=3)]) == ("prefix", "a")


def test_load_can_outweigh_a_longer_match_elsewhere() -> None:
    busy, idle = candidate("a", 320, held=3), candidate("b", 256)
    assert chosen([busy, idle]) == ("load", "b")


@pytest.mark.parametrize(
    "saturated",
    [
        candidate("a", 320, held=2, queued=2),  # its jobs fill its capacity
        candidate("a", 320, draining=True),
        candidate("a", 320, intake_open=False),  # its engine waits for KV blocks
    ],
)
def test_a_saturated_worker_is_never_chosen(saturated: Candidate) -> None:
    assert saturated.saturated
    assert chosen([saturated, candidate("b", 0)]) == ("shared", None)
    assert chosen([saturated, candidate("b", 48)]) == ("load", "b")


async def test_the_placer_reads_summaries_and_loads_in_redis() -> None:
    """Real sets and taken records: the worker holding the prompt's blocks gets its own queue."""
    redis = Redis.from_url(REDIS_URL)
    model, run = f"model-{uuid.uuid4().hex}", uuid.uuid4().hex
    names = [f"holder-{run}", f"other-{run}"]
    prompt = list(range(100, 180))  # 80 tokens: 4 blocks usable, the last token left out
    chain = prefix_hashes(prompt, 16)
    loads = tuple(WorkerLoad(name, model, capacity=4, block_size=16) for name in names)
    snapshot = FleetSnapshot(loads)
    placer = Placer(redis, model, lambda: snapshot, POLICY)
    try:
        await redis.sadd(keys.cache_summary(names[0]), *[digest(h) for h in chain[:3]])
        await redis.sadd(keys.cache_summary(names[1]), digest(chain[1]))  # no leading block
        await redis.hset(keys.taken(names[0]), "tag", "record")

        placement = await placer.place(prompt)

        assert placement.kind == "prefix" and placement.worker == names[0]
        assert placement.queue == keys.own_queue(model, names[0])
        assert placement.matched_tokens == 48
        assert placement.hand_back_at == pytest.approx(time.time() + POLICY.wait_s, abs=1)
        assert await placer.place(prompt[:20]) == SHARED  # too short to match anything useful
        await redis.hset(keys.taken(names[0]), mapping={f"t{n}": "r" for n in range(3)})
        assert await placer.place(prompt) == SHARED  # its jobs fill its capacity now
        assert placer.placed == {"prefix": 1, "shared": 2}
    finally:
        await redis.delete(*[keys.cache_summary(n) for n in names], keys.taken(names[0]))
        await redis.aclose()


async def test_redis_unreachable_places_on_the_shared_queue() -> None:
    redis = Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    load = WorkerLoad("w", "m", capacity=4, block_size=16)
    placer = Placer(redis, "m", lambda: FleetSnapshot((load,)), POLICY)
    try:
        assert await placer.place(list(range(100))) == SHARED
    finally:
        await redis.aclose()
