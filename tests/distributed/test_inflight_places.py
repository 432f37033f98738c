"""Admission against a real Redis: the bound holds across API processes and bursts.

Each ``Admission`` here stands for one API process: its own Redis client and
its own ``InflightPlaces``, sharing one in-flight set, as replicas behind a
load balancer do.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from redis.asyncio import Redis

from api.admission import Admission, FleetSnapshot, Limits, WorkerLoad
from api.backends.inflight import RESERVATION_S, InflightPlaces
from api.errors import ApiError
from shared import keys
from tests.distributed.conftest import RedisServer
from tests.servers import free_port

pytestmark = pytest.mark.distributed

LIVE = FleetSnapshot(workers=(WorkerLoad("w1", "m", capacity=8),), taken_at=1.0)


def _process(url: str, model: str, bound: int) -> tuple[Admission, InflightPlaces, Redis]:
    client = Redis.from_url(url, decode_responses=True)
    places = InflightPlaces(client, model, bound)
    return (
        Admission(Limits(max_inflight=bound), lambda: LIVE, places.reserve, places.release),
        places,
        client,
    )


async def _request(admission: Admission, hold: asyncio.Event, fail: bool = False) -> str:
    try:
        async with admission.admit(uuid.uuid4().hex):
            await hold.wait()  # still preparing while the others are admitted
            if fail:
                raise ApiError(400, "bad request", "invalid_request_error")
            return "admitted"
    except ApiError as error:
        return str(error.status)


def test_two_processes_share_the_bound_without_overshoot(redis_server: RedisServer) -> None:
    model = f"places-{uuid.uuid4().hex}"
    future = time.time() + 600
    redis_server.client.zadd(keys.inflight(model), {"running-1": future, "running-2": future})
    redis_server.client.zadd(keys.inflight(model), {"crashed-long-ago": time.time() - 5})

    async def main() -> list[str]:
        first, _, client_a = _process(redis_server.url, model, bound=5)
        second, _, client_b = _process(redis_server.url, model, bound=5)
        hold = asyncio.Event()
        burst = [
            asyncio.create_task(_request(first if index % 2 else second, hold))
            for index in range(10)
        ]
        await asyncio.sleep(0.2)
        hold.set()
        outcomes = await asyncio.gather(*burst)
        await client_a.aclose()
        await client_b.aclose()
        return outcomes

    outcomes = asyncio.run(main())
    assert outcomes.count("admitted") == 3  # 2 running + 3 = the bound of 5
    assert outcomes.count("429") == 7
    live = redis_server.client.zcount(keys.inflight(model), time.time(), "+inf")
    assert live == 5  # the admitted keep their places until their jobs end


def test_a_burst_takes_its_places_in_one_round_trip(redis_server: RedisServer) -> None:
    model = f"places-{uuid.uuid4().hex}"

    async def main() -> tuple[list[str], int]:
        admission, places, client = _process(redis_server.url, model, bound=100)
        calls = 0
        reserve = places.reserve

        async def counted(request_ids: list[str]) -> set[str]:
            nonlocal calls
            calls += 1
            return await reserve(request_ids)

        admission._reserve = counted
        hold = asyncio.Event()
        hold.set()
        outcomes = await asyncio.gather(*(_request(admission, hold) for _ in range(10)))
        await client.aclose()
        return outcomes, calls

    outcomes, calls = asyncio.run(main())
    assert outcomes == ["admitted"] * 10
    assert calls == 1


def test_a_request_that_fails_before_submission_gives_its_place_back(
    redis_server: RedisServer,
) -> None:
    model = f"places-{uuid.uuid4().hex}"

    async def main() -> list[str]:
        admission, _, client = _process(redis_server.url, model, bound=5)
        hold = asyncio.Event()
        hold.set()
        outcomes = [await _request(admission, hold, fail=True), await _request(admission, hold)]
        await asyncio.sleep(0.1)  # the give-back runs as a task of its own
        await client.aclose()
        return outcomes

    started = time.time()
    assert asyncio.run(main()) == ["400", "admitted"]
    places = redis_server.client.zrange(keys.inflight(model), 0, -1, withscores=True)
    assert len(places) == 1  # only the admitted request's
    assert started + RESERVATION_S - 1 < places[0][1] < time.time() + RESERVATION_S + 1


def test_a_client_gone_while_waiting_leaves_no_place_behind(redis_server: RedisServer) -> None:
    model = f"places-{uuid.uuid4().hex}"

    async def main() -> None:
        admission, _, client = _process(redis_server.url, model, bound=5)
        waiting = asyncio.create_task(_request(admission, asyncio.Event()))
        await asyncio.sleep(0)  # it has asked for a place; the reservation is on its way
        waiting.cancel()
        await asyncio.sleep(0.2)
        await client.aclose()

    asyncio.run(main())
    assert redis_server.client.zcard(keys.inflight(model)) == 0


def test_an_unreachable_redis_is_a_503_for_a_burst_and_for_the_next_request() -> None:
    async def main() -> list[str]:
        admission, _, client = _process(
            f"redis://127.0.0.1:{free_port()}/0", f"places-{uuid.uuid4().hex}", bound=5
        )
        hold = asyncio.Event()
        hold.set()
        outcomes = await asyncio.gather(*(_request(admission, hold) for _ in range(3)))
        outcomes.append(await _request(admission, hold))
        await client.aclose()
        return outcomes

    assert asyncio.run(main()) == ["503"] * 4
