"""Offline inference: a list of prompts in, a list of completions out.

The batch runs through the same ``LLMEngine.step()`` loop as the server, so
continuous batching, prefix caching and preemption all apply.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from shared.events import Finish, FinishReason, Ready, Text, TokenLogprob
from shared.images.decoding import MAX_DECODED_PIXELS, DecodedImage, open_image
from shared.images.layout import ImageProcessing, expand_images
from shared.sampling import SamplingParams
from shared.tokenization import encode_text
from shared.wire import WireImage

Picture = Image.Image | bytes  # a picture, or an image file's bytes (JPEG, PNG, GIF, WebP)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens after the first
    finish_reason: FinishReason | None = None
    stop: str | int | None = None
    cached_tokens: int = 0


class LLM:
    def __init__(self, model: str = "default", **engine_args: Any):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        engine_args.setdefault("log_stats", False)
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self.engine.warm_up()
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def encode(self, prompt: str) -> list[int]:
        """A prompt → ids, with BOS when the model wants one.

        Offline, the caller writes the prompt, so its control-token spellings are control tokens.
        """
        return encode_text(prompt, self.tokenizer, control_tokens=True)

    def generate(
        self,
        prompts: SequenceABC[str] | SequenceABC[list[int]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        images: SequenceABC[SequenceABC[Picture]] | None = None,
    ) -> list[RequestOutput]:
        """Complete ``prompts``; ``images[i]`` are prompt i's pictures, one per ``<image>``
        it writes, in order (a vision model's text prompts only)."""
        params = self._per_prompt(sampling_params, len(prompts))
        pictures = [()] * len(prompts) if images is None else images
        if len(pictures) != len(prompts):
            raise ValueError(f"got images for {len(pictures)} prompts; there are {len(prompts)}")
        outputs: dict[str, RequestOutput] = {}
        for prompt, p, seen in zip(prompts, params, pictures, strict=True):
            ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
            ids, wire = self._with_images(ids, seen) if seen else (ids, [])
            request_id = f"offline-{self._counter}"
            self._counter += 1
            outputs[request_id] = RequestOutput(request_id, ids)
            if p.logprobs is not None:
                outputs[request_id].logprobs = []
            self.engine.add_request(request_id, ids, p, images=wire)
        while self.engine.has_unfinished():
            for event in self.engine.step():
                _apply(outputs[event.request_id], event)
        return list(outputs.values())

    def _with_images(
        self, ids: list[int], pictures: SequenceABC[Picture]
    ) -> tuple[list[int], list[WireImage]]:
        processing = self.engine.image_processing
        if processing is None:
            raise ValueError(f"model {self.engine.args.model!r} does not accept images")
        decoded = [_decoded(picture, processing) for picture in pictures]
        return expand_images(ids, decoded, processing, self.tokenizer)

    @staticmethod
    def _per_prompt(
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(count)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(
                f"got {len(sampling_params)} sampling_params for {count} prompts; "
                "pass one, or one per prompt"
            )
        return list(sampling_params)


def _decoded(picture: Picture, processing: ImageProcessing) -> DecodedImage:
    """A picture decoded as the server decodes it for the model."""
    if isinstance(picture, bytes):
        data = picture
    else:
        buffer = io.BytesIO()
        picture.save(buffer, "PNG")
        data = buffer.getvalue()
    return processing.decode(open_image(data, MAX_DECODED_PIXELS), data, "auto")


def _apply(output: RequestOutput, event: object) -> None:
    if isinstance(event, Ready):
        output.cached_tokens = event.cached_tokens
        output.prompt_logprobs = event.prompt_logprobs
    elif isinstance(event, Text):
        output.text += event.text
        output.token_ids += event.token_ids
        if output.logprobs is not None and event.logprobs:
            output.logprobs += event.logprobs
    elif isinstance(event, Finish):
        output.finish_reason = event.reason
        output.stop = event.stop
