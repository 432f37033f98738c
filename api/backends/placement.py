"""Placement: a request goes to the worker whose cache holds its prefix, unless that worker
is busier than the cache is worth; otherwise to the model's shared queue.

Each worker mirrors the prefix block hashes its engine's cache holds into
a Redis set (``workers.cache_summary``) and takes jobs from its own queue
(``keys.own_queue``) before the shared one. For a request whose prompt has
at least ``min_match`` tokens in full blocks, one pipelined round trip reads,
for every live worker of the model: which of the prompt's block hashes its
summary holds (``SMISMEMBER``; the matched prefix is the leading run), how
many jobs it holds (its taken records) and how many wait on its own queue.
Those two are exact at this instant; the heartbeat adds what they cannot
say (draining, an engine waiting for KV blocks, its capacity).

A worker is saturated when it drains, its engine waits for KV blocks, or its
held and own-queued jobs fill its capacity: the request would wait there.
Among the others, the worker with the highest ``matched - load_cost * jobs``
is chosen if that beats the shared queue's ``-load_cost * (fewest jobs)``,
that is if its cached tokens outweigh ``load_cost`` tokens per job it holds
beyond the least busy worker, and it matches at least ``min_match``. The
choice is "prefix" when the chosen worker has the longest match of all,
"load" when a busier one had a longer match; anything else is "shared".

A job on a worker's own queue carries the time it is handed back to the
shared queue if it is still there (``wait_s`` from now), and the worker's
heartbeat moves it then; when the worker drains, leaves or dies, its whole
own queue moves at once (``workers/broker/scripts``). Reads are concurrent
with other API processes' placements: two may both see a free slot, and
the later job then waits on the own queue until a slot frees or its hand-back.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from api.backends.fleet_snapshot import FleetSnapshot
from api.store_errors import store_errors
from shared import keys
from shared.flags import flag
from shared.prefix_hash import ImageSpan, digest, prefix_hashes
from shared.wire import WorkerLoad

if TYPE_CHECKING:
    from redis.asyncio import Redis

log = logging.getLogger(__name__)

DEFAULT_LOAD_COST = 128.0  # tokens; the README's benchmark section (python -m bench.routing)
DEFAULT_MIN_MATCH = 32  # tokens: two blocks of 16; less is no reason to prefer a worker
DEFAULT_WAIT_S = 2.0
READ_TIMEOUT_S = 2.0
KINDS = ("prefix", "load", "shared")


def _prefix_or_shared(text: str) -> bool:
    """``--placement``: whether prefix placement is on."""
    if text not in ("prefix", "shared"):
        raise argparse.ArgumentTypeError(f"expected prefix or shared, got {text!r}")
    return text == "prefix"


@dataclass(frozen=True, slots=True)
class PlacementPolicy:
    """The placement's knobs (``sluice serve --placement-*``)."""

    enabled: bool = field(
        default=True,
        metadata=flag(
            "with --redis: prefix puts a request on the worker caching its prompt's prefix "
            "unless it is busier than the cache is worth; shared puts every one on the shared "
            "queue",
            names=("--placement",),
            parse=_prefix_or_shared,
            choices=(True, False),
            metavar="{prefix,shared}",
        ),
    )
    load_cost: float = field(
        default=DEFAULT_LOAD_COST,
        metadata=flag(
            "cached prompt tokens that one more job held by a worker outweighs",
            names=("--placement-load-cost",),
            parse=float,
            metavar="TOKENS",
        ),
    )
    min_match: int = field(
        default=DEFAULT_MIN_MATCH,
        metadata=flag(
            "a worker caching fewer of the prompt's tokens is no reason to place there",
            names=("--placement-min-match",),
            parse=int,
            metavar="TOKENS",
        ),
    )
    wait_s: float = field(
        default=DEFAULT_WAIT_S,
        metadata=flag(
            "a job placed on a worker's own queue goes to the shared queue after S seconds",
            names=("--placement-wait",),
            parse=float,
            metavar="S",
        ),
    )


class Placement(NamedTuple):
    """Where one request goes: ``queue`` None is the model's shared queue."""

    kind: str
    queue: str | None = None
    worker: str | None = None
    matched_tokens: int = 0
    hand_back_at: float | None = None


SHARED = Placement("shared")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One live worker as placement reads it."""

    load: WorkerLoad
    matched_tokens: int  # its cache's leading run of the prompt's blocks, in tokens
    held: int  # jobs it took and has not ended (its taken records)
    queued: int  # jobs waiting on its own queue

    @property
    def jobs(self) -> int:
        return self.held + self.queued

    @property
    def saturated(self) -> bool:
        load = self.load
        return load.draining or not load.intake_open or self.jobs >= max(load.capacity, 1)


def choose(
    candidates: Sequence[Candidate], policy: PlacementPolicy
) -> tuple[str, Candidate | None]:
    """The kind of placement and the chosen worker (None: the shared queue); see the module."""
    free = [candidate for candidate in candidates if not candidate.saturated]
    if not free:
        return "shared", None

    def score(candidate: Candidate) -> float:
        return candidate.matched_tokens - policy.load_cost * candidate.jobs

    best = max(free, key=lambda candidate: (score(candidate), -candidate.jobs))
    shared_score = -policy.load_cost * min(candidate.jobs for candidate in free)
    if best.matched_tokens < max(policy.min_match, 1) or score(best) <= shared_score:
        return "shared", None
    longest = max(candidate.matched_tokens for candidate in candidates)
    return ("prefix" if best.matched_tokens == longest else "load"), best


class Placer:
    """Places one model's requests; see the module docstring."""

    def __init__(
        self,
        redis: Redis,
        model: str,
        snapshot: Callable[[], FleetSnapshot],
        policy: PlacementPolicy,
    ) -> None:
        self._redis = redis
        self._model = model
        self._snapshot = snapshot
        self.policy = policy
        self.placed: Counter[str] = Counter()  # placements by kind, for ``/metrics``

    async def place(self, token_ids: Sequence[int], images: Sequence[ImageSpan] = ()) -> Placement:
        """Where a prompt of ``token_ids`` (with ``images``) goes; the shared queue when Redis
        fails to say."""
        placement = SHARED
        if self.policy.enabled:
            try:
                placement = await self._place(token_ids, images)
            except (*store_errors(), TimeoutError) as exc:
                log.warning("reading the workers' caches failed; using the shared queue: %s", exc)
        self.placed[placement.kind] += 1
        return placement

    async def _place(self, token_ids: Sequence[int], images: Sequence[ImageSpan]) -> Placement:
        workers = [worker for worker in self._snapshot().live if worker.block_size > 0]
        if not workers:
            return SHARED
        if len(token_ids) - 1 < self.policy.min_match:  # the engine recomputes the last token
            return SHARED
        chains = prompt_chains(token_ids, workers, images)
        if not all(chains.values()):
            return SHARED
        candidates = await self._read(workers, chains)
        kind, chosen = choose(candidates, self.policy)
        if chosen is None:
            return SHARED
        worker_id = chosen.load.worker_id
        return Placement(
            kind,
            keys.own_queue(self._model, worker_id),
            worker_id,
            chosen.matched_tokens,
            time.time() + self.policy.wait_s,
        )

    async def _read(
        self, workers: list[WorkerLoad], chains: dict[int, list[bytes]]
    ) -> list[Candidate]:
        """Each worker's match, held jobs and own-queue length, in one round trip."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for worker in workers:
                pipe.smismember(keys.cache_summary(worker.worker_id), chains[worker.block_size])
                pipe.hlen(keys.taken(worker.worker_id))
                pipe.llen(keys.queue_wake(keys.own_queue(self._model, worker.worker_id)))
            async with asyncio.timeout(READ_TIMEOUT_S):
                replies = await pipe.execute()
        candidates = []
        for index, worker in enumerate(workers):
            members, held, queued = replies[3 * index : 3 * index + 3]
            matched = _leading(members) * worker.block_size
            candidates.append(Candidate(worker, matched, int(held), int(queued)))
        return candidates


def prompt_chains(
    token_ids: Sequence[int], workers: list[WorkerLoad], images: Sequence[ImageSpan] = ()
) -> dict[int, list[bytes]]:
    """The digests of the blocks a cache could serve, per block size the workers use.

    The engine never serves a prompt's last token from the cache, so a block
    ending on it is left out.
    """
    chains = {}
    for block_size in {worker.block_size for worker in workers}:
        usable = (len(token_ids) - 1) // block_size * block_size
        hashes = prefix_hashes(token_ids[:usable], block_size, images)
        chains[block_size] = [digest(h) for h in hashes]
    return chains


def _leading(members: Sequence[int | bool]) -> int:
    """How many of the first blocks are all held: a prefix matches block by block."""
    count = 0
    for member in members:
        if not member:
            break
        count += 1
    return count
