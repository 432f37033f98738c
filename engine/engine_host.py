"""What every host of an ``LLMEngine`` does with it the same way, on its engine thread.

The embedded backend (``api.backends.embedded``) and a worker's host
(``workers.host``) each run one engine on an ``engine.engine_thread.EngineThread``.
Both add requests, end them when a step fails and report the engine's load;
those three live here, so a request meets the same refusals and failures, and
a dashboard the same numbers, in either mode. What a request is to its host
and how its events reach a client stay with the host.

Every function here touches the engine: call it on the engine thread only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, TypeVar

from shared.engine_metrics import EngineLoad
from shared.events import Accepted, Error

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from shared.wire import PreparedRequest

log = logging.getLogger(__name__)

Load = TypeVar("Load", bound=EngineLoad)


def add_request(
    engine: LLMEngine,
    request: PreparedRequest,
    engine_id: str | None = None,
    *,
    generated_token_ids: list[int] | None = None,
    emitted_chars: int = 0,
) -> Accepted | Error:
    """Add ``request`` to the engine as ``engine_id`` (its request id unless given);
    the event that answers it for its client: ``Accepted`` once it is in, else the
    ``Error`` that ends it.

    A ``ValueError`` is the engine refusing what it cannot run (a prompt too
    long, a token outside the vocabulary, a bad image): an ``invalid_request``
    with the engine's words. Anything else is the engine failing: the request
    is aborted, in case it got in before the failure, and its client is told
    the engine failed instead of waiting for events that never come.
    ``generated_token_ids`` and ``emitted_chars`` resume a request another
    engine began (``LLMEngine.add_request``).
    """
    if engine_id is None:
        engine_id = request.request_id
    try:
        engine.add_request(
            engine_id,
            request.prompt_token_ids,
            request.sampling,
            request.priority,
            generated_token_ids=generated_token_ids,
            emitted_chars=emitted_chars,
            images=request.images,
        )
    except ValueError as exc:
        return Error(request.request_id, str(exc), "invalid_request")
    except Exception as exc:
        log.exception("adding %s to the engine failed", request.request_id)
        engine.abort(engine_id)
        return Error(request.request_id, _failed(exc))
    return Accepted(request.request_id)


def end_after_failed_step(
    engine: LLMEngine, exc: Exception, request_ids: list[str] | None = None
) -> list[Error]:
    """Abort every request the engine holds after ``exc`` failed a step; an ``Error`` for
    each of ``request_ids`` (by default the engine's own ids) ends them for their clients.

    A failed step leaves the batch's state unknown, so no request goes on:
    aborting frees their KV blocks, and one step drains the aborts' ``Finish``
    events, which are no one's (each request's end is its ``Error``). A host
    whose requests are not all in the engine passes its own ids: a request
    aborted just before the failure waits for a ``Finish`` the failed step lost.
    """
    if request_ids is None:
        request_ids = list(engine.sequences)
    for engine_id in list(engine.sequences):
        engine.abort(engine_id)
    try:
        engine.step()  # nothing is scheduled: it only returns the aborts' Finish events
    except Exception:  # the Errors must go out all the same
        log.exception("draining the aborts after a failed step failed")
    message = _failed(exc)
    return [Error(request_id, message) for request_id in request_ids]


def read_load(engine: LLMEngine, record: type[Load], **host: object) -> Load:
    """The engine's load now, as ``record``: ``EngineLoad``, or a host's extension of it
    given the host's own fields in ``host``. One record per call, so a reader on
    another thread sees one consistent snapshot when it is published by one
    assignment."""
    scheduler, stats, blocks = engine.scheduler, engine.stats, engine.block_manager
    return record(
        running=len(scheduler.running),
        waiting=len(scheduler.waiting),
        kv_blocks_used=blocks.num_blocks - blocks.num_free_blocks,
        kv_blocks_total=blocks.num_blocks,
        preemptions=stats.preemptions,
        steps=stats.steps,
        generated_tokens=stats.tokens,
        aborted=stats.aborted,
        **host,
    )


def _failed(exc: Exception) -> str:
    return f"the engine failed: {exc}"
