"""The step loop that the offline ``LLM`` and the workers both drive.

``step()`` is schedule → run → postprocess. The engine is single-threaded by
design: whoever hosts it (a script, the embedded server's engine thread, a
worker) calls ``add_request``, ``abort`` and ``step`` from one thread.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Sequence as SequenceABC

from engine.block_manager import BlockManager
from engine.config import EngineArgs
from engine.constraints import Constraints
from engine.detokenizer import OutputText
from engine.model import vnni_gemm
from engine.model.idefics3 import Idefics3ForConditionalGeneration
from engine.model.llama import LlamaForCausalLM
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.setup import LoadedModel, load_engine_model
from engine.vision import SequenceVision, sequence_vision
from shared.events import Finish, FinishReason, InferenceEvent, Ready, Text, TokenLogprob
from shared.images.idefics3 import Idefics3Processing
from shared.sampling import SamplingParams
from shared.wire import WireImage

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None):
        self.args = args
        loaded = loaded or load_engine_model(args)
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.model.cfg
        self.max_model_len = loaded.max_model_len
        self.precision = loaded.precision
        self.block_manager = BlockManager(
            loaded.num_blocks, args.block_size, args.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            args.max_num_seqs,
            max(args.max_num_batched_tokens, args.block_size),
        )
        compiled = (
            not args.enforce_eager
            and loaded.device.type == "cpu"
            and isinstance(loaded.model, LlamaForCausalLM)
        )
        self.runner = ModelRunner(
            loaded.model,
            loaded.attention,
            args.block_size,
            loaded.device,
            args.max_num_seqs if compiled else 0,
        )
        self.image_processing = loaded.image_processing
        self.sampler = Sampler()
        self.constraints = Constraints(loaded.tokenizer, self.model_config.vocab_size)
        self.sequences: dict[str, Sequence] = {}
        self._pending: list[InferenceEvent] = []
        self._seeds = random.Random(args.seed)
        self.stats = EngineStats()
        self.description = (
            f"{args.model}: attention {loaded.attention.name}, "
            f"{str(loaded.dtype).removeprefix('torch.')} on {loaded.device} "
            f"({loaded.precision.reason}), weights {_weights(loaded.quantized)}, "
            f"max_model_len {self.max_model_len}, "
            f"{loaded.num_blocks} KV blocks of {args.block_size} "
            f"in {str(loaded.precision.kv_dtype).removeprefix('torch.')}, "
            f"decode steps {'compiled once warm' if compiled else 'eager'}, "
            f"{'batch-invariant' if loaded.precision.batch_invariant else 'not batch-invariant'}"
        )
        log.info("engine ready: %s", self.description)

    @classmethod
    def from_args(cls, **kwargs: object) -> LLMEngine:
        return cls(EngineArgs(**kwargs))  # type: ignore[arg-type]

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
        """Queue a request.

        ``images`` are the prompt's: each is decoded now (a ``ValueError`` if it
        is not an image or does not fit its span), preprocessed and encoded when
        a chunk first reaches its tokens, and its features fill them.

        ``generated_token_ids`` resumes a request that another engine began:
        they count as output already produced (budget, penalties and the seeded
        draws continue from there), and ``emitted_chars`` says how much of
        their text the client already has, so held-back text is not lost. A
        constrained request's matcher replays them, so it continues the same
        grammar where the other engine stopped.
        """
        generated = list(generated_token_ids or [])
        self._validate(request_id, prompt_token_ids + generated, params)
        matcher = (
            self.constraints.matcher(params.structured_outputs, generated)
            if params.structured_outputs is not None
            else None
        )
        seq = Sequence(
            request_id,
            list(prompt_token_ids) + generated,
            params,
            priority,
            num_prompt_tokens=len(prompt_token_ids),
        )
        seq.matcher = matcher
        if images:
            seq.images = [image.span for image in images]
            seq.vision = self._vision(images, prompt_token_ids)
        if params.prompt_logprobs is not None and not generated:  # a resumed one has them
            seq.prompt_logprobs = []
        seq.seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        seq.stop_token_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(self.tokenizer.stop_token_ids)
        )
        seq.output = OutputText.start(
            self.tokenizer.tokenizer,
            seq.token_ids,
            params.stop,
            params.skip_special_tokens,
            resumed=(generated, emitted_chars),
        )
        self.sequences[request_id] = seq
        self.scheduler.add(seq)

    def _vision(self, images: SequenceABC[WireImage], prompt: list[int]) -> SequenceVision:
        model, processing = self.runner.model, self.image_processing
        if not isinstance(model, Idefics3ForConditionalGeneration):
            raise ValueError(
                f"model {self.args.model!r} does not accept images: this engine runs no vision "
                "encoder for it"
            )
        assert isinstance(processing, Idefics3Processing)  # loaded with the Idefics3 checkpoint
        assert self.model_config.image_token_id is not None
        image_token_id, tokens_per_tile = (
            self.model_config.image_token_id,
            model.vision.tokens_per_tile,
        )
        return sequence_vision(images, prompt, processing, image_token_id, tokens_per_tile)

    def abort(self, request_id: str) -> bool:
        """Stop a request now: its blocks are free when this returns."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.matcher = None
        self._pending.append(Finish(request_id, FinishReason.ABORT, seq.num_output_tokens))
        self.stats.aborted += 1
        return True

    def warm_up(self, background: bool = False) -> None:
        """Load the compiled decode steps, compiling them first if no start has; with
        ``background`` the compile runs on a thread of its own while steps run eagerly (a
        server answers at once). Call it on the thread that steps."""
        self.runner.warm_up(background)

    def has_unfinished(self) -> bool:
        return bool(self.sequences) or bool(self._pending)

    def step(self) -> list[InferenceEvent]:
        events, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        for seq in batch.preempted:
            seq.matcher = None  # freed with its blocks; rebuilt from its tokens when it samples
        if not batch.scheduled:
            return events
        masks = self.constraints.start_masks([i.seq for i in batch.scheduled if i.samples])
        step = self.runner.run(batch.scheduled)
        logits, sampling = step.logits, step.sampling
        for seq, entries in step.prompt_logprobs:
            assert seq.prompt_logprobs is not None
            seq.prompt_logprobs += entries
        seqs = [item.seq for item in sampling]
        mask = None
        if masks is not None:
            row_of = {id(seq): row for row, seq in enumerate(seqs)}
            mask = masks.result(row_of, logits.shape[-1])
        tokens, logprobs = self.sampler(logits, seqs, mask)
        events += self._postprocess(batch, sampling, tokens, logprobs)
        return events

    def _validate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already running")
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; the maximum is "
                f"{self.max_model_len - 1} (max_model_len {self.max_model_len} minus one)"
            )
        vocab = self.model_config.vocab_size
        for field, ids in (
            ("prompt_token_ids", prompt_token_ids),
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", list(params.logit_bias)),
        ):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"{field}: token id {bad} is outside the vocabulary [0, {vocab})")

    def _postprocess(
        self,
        batch: SchedulerOutput,
        sampling: list[ScheduledSeq],
        tokens: list[int],
        logprobs: list[TokenLogprob | None],
    ) -> list[InferenceEvent]:
        events: list[InferenceEvent] = []
        self.stats.preemptions += len(batch.preempted)
        for item in batch.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_tokens
            self.block_manager.commit(seq)
            if not seq.announced and not seq.needs_prompt_logprobs:
                seq.announced = True
                events.append(
                    Ready(
                        seq.request_id,
                        seq.num_prompt_tokens,
                        seq.num_cached_tokens,
                        seq.prompt_logprobs,
                    )
                )
        for item, token, logprob in zip(sampling, tokens, logprobs, strict=True):
            if item.seq.params.max_tokens == 0:  # prefill only: the prompt logprobs were the point
                self._finish(item.seq)
                events.append(Finish(item.seq.request_id, FinishReason.LENGTH, 0))
                continue
            events += self._append_token(item.seq, token, logprob)
        self.stats.steps += 1
        self.stats.tokens += len(sampling)
        if self.args.log_stats:
            self.stats.log_if_due(self)
        return events

    def _append_token(
        self, seq: Sequence, token: int, logprob: TokenLogprob | None
    ) -> list[InferenceEvent]:
        seq.token_ids.append(token)
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            log.warning(
                "%s: grammar refused token %d: %s", seq.request_id, token, seq.matcher.get_error()
            )
        reason, stop = self._finish_reason(seq, token)
        text = seq.output.take(final=reason is not None)
        events: list[InferenceEvent] = [
            Text(seq.request_id, text, [token], [logprob] if logprob else None)
        ]
        if reason is not None:
            self._finish(seq)
            events.append(Finish(seq.request_id, reason, seq.num_output_tokens, stop))
        return events

    def _finish_reason(
        self, seq: Sequence, token: int
    ) -> tuple[FinishReason | None, str | int | None]:
        if seq.num_output_tokens <= seq.params.min_tokens:  # no stop of any kind before min_tokens
            seq.output.append(token, stops=False)
            return self._grammar_reason(seq) or self._length_reason(seq), None
        if token in seq.stop_token_ids:
            return FinishReason.STOP, token
        if seq.output.append(token):
            return FinishReason.STOP, seq.output.matched_stop
        return self._grammar_reason(seq) or self._length_reason(seq), None

    @staticmethod
    def _grammar_reason(seq: Sequence) -> FinishReason | None:
        """A grammar that allows no further token (complete, or refused) ends the sequence."""
        matcher = seq.matcher
        if matcher is not None and (matcher.is_stopped() or matcher.is_error()):
            return FinishReason.STOP
        return None

    def _length_reason(self, seq: Sequence) -> FinishReason | None:
        if seq.num_output_tokens >= seq.params.max_tokens or len(seq) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.matcher = None
        self.scheduler.remove(seq)
        del self.sequences[seq.request_id]


class EngineStats:
    """Counters a host reads for metrics and tests (steps, tokens, aborts)."""

    LOG_INTERVAL_S = 10.0

    def __init__(self) -> None:
        self.steps = 0
        self.tokens = 0
        self.preemptions = 0
        self.aborted = 0
        self._logged_at = time.monotonic()
        self._logged_tokens = 0

    def log_if_due(self, engine: LLMEngine) -> None:
        """One line of throughput and cache use every ``LOG_INTERVAL_S`` seconds."""
        now = time.monotonic()
        if now - self._logged_at < self.LOG_INTERVAL_S:
            return
        rate = (self.tokens - self._logged_tokens) / (now - self._logged_at)
        blocks = engine.block_manager
        log.info(
            "running %d, waiting %d, %.1f tokens/s, KV blocks %d/%d used, %d preemptions",
            len(engine.scheduler.running),
            len(engine.scheduler.waiting),
            rate,
            blocks.num_blocks - blocks.num_free_blocks,
            blocks.num_blocks,
            self.preemptions,
        )
        self._logged_at, self._logged_tokens = now, self.tokens


def _weights(quantized: dict[str, str]) -> str:
    """How the linear layers are stored and multiplied, e.g. "int4 x120, int8 x1 on the VNNI
    kernels" or "dense"."""
    counts = Counter(quantized.values())
    if not counts:
        return "dense"
    stored = ", ".join(f"{method} x{count}" for method, count in sorted(counts.items()))
    kernels = "the VNNI kernels" if vnni_gemm.available() else "PyTorch's kernels"
    return f"{stored} on {kernels}"
