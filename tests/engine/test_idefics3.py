"""Idefics3 (SmolVLM) against transformers: preprocessing, prompt layout, logits, prefix cache.

The model is random-weight, of the real architecture, built by transformers
and saved as an HF directory (``bench.vision_model``); the engine loads it
through the real loader like any checkpoint.
"""

from __future__ import annotations

import base64
import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers.models.idefics3.image_processing_pil_idefics3 import (
    Idefics3ImageProcessorPil,
)

from bench.vision_model import make_idefics3
from engine import LLM
from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.vision import sequence_vision
from shared.events import Ready, Text
from shared.images.idefics3 import Idefics3Processing, prompt_string
from shared.images.loading import load_image_processing
from shared.sampling import SamplingParams
from shared.wire import WireImage

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
FAKE_IMAGE = "<fake_token_around_image>"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_idefics3(tmp_path_factory.mktemp("idefics3"))


@pytest.fixture(scope="module")
def reference(vlm: Path) -> transformers.Idefics3ForConditionalGeneration:
    return transformers.Idefics3ForConditionalGeneration.from_pretrained(vlm).eval()


def picture(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


@dataclass
class Prompt:
    ids: list[int]
    images: list[WireImage] = field(default_factory=list)
    pictures: list[Image.Image] = field(default_factory=list)


def build_prompt(engine: LLMEngine, pieces: list[str | Image.Image]) -> Prompt:
    """A SmolVLM-format user turn of text and pictures, each picture laid out as the API does."""
    tokenizer = engine.tokenizer.tokenizer
    processing = engine.image_processing
    assert processing is not None
    prompt = Prompt(tokenizer.encode("<|im_start|>User:", add_special_tokens=False).ids)
    for piece in pieces:
        if isinstance(piece, str):
            prompt.ids += tokenizer.encode(piece, add_special_tokens=False).ids
            continue
        layout = prompt_string(*processing.grid(*piece.size), processing.image_seq_len)
        start = len(prompt.ids)
        prompt.ids += tokenizer.encode(layout, add_special_tokens=False).ids
        data = png(piece)
        digest = hashlib.blake2b(piece.tobytes(), digest_size=16).hexdigest()
        encoded = base64.b64encode(data).decode("ascii")
        prompt.images.append(WireImage(encoded, digest, start, len(prompt.ids)))
        prompt.pictures.append(piece)
    prompt.ids += tokenizer.encode("<end_of_utterance>\nAssistant:", add_special_tokens=False).ids
    return prompt


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached: int = 0


def run(engine: LLMEngine, prompts: dict[str, Prompt]) -> dict[str, Outcome]:
    outcomes = {name: Outcome() for name in prompts}
    for name, prompt in prompts.items():
        engine.add_request(name, prompt.ids, GREEDY, images=prompt.images)
    while engine.has_unfinished():
        for event in engine.step():
            outcome = outcomes[event.request_id]
            if isinstance(event, Ready):
                outcome.cached = event.cached_tokens
            elif isinstance(event, Text):
                outcome.tokens += event.token_ids
                outcome.logprobs += [entry.logprob for entry in event.logprobs or []]
    return outcomes


def reference_logprobs(
    model: transformers.Idefics3ForConditionalGeneration,
    processor: Idefics3ImageProcessorPil,
    prompt: Prompt,
    tokens: list[int],
) -> torch.Tensor:
    """transformers' log-probabilities of ``tokens`` after ``prompt``, teacher-forced."""
    inputs: dict[str, torch.Tensor] = {}
    if prompt.pictures:
        processed = processor([prompt.pictures], return_tensors="pt")
        inputs = {
            "pixel_values": processed["pixel_values"],
            "pixel_attention_mask": processed["pixel_attention_mask"],
        }
    with torch.no_grad():
        ids = torch.tensor([prompt.ids + tokens[:-1]])
        logits = model(input_ids=ids, **inputs).logits[0, len(prompt.ids) - 1 :]
    return torch.log_softmax(logits, -1)


def make_engine(vlm: Path, **args: object) -> LLMEngine:
    return LLMEngine(
        EngineArgs(
            model=str(vlm),
            dtype="float32",
            max_model_len=2048,
            num_kv_blocks=256,
            log_stats=False,
            **args,
        )
    )


@pytest.mark.parametrize("size", [(100, 70), (70, 100), (20, 30), (128, 128), (300, 40)])
def test_preprocessing_and_layout_match_transformers(vlm: Path, size: tuple[int, int]) -> None:
    ours = load_image_processing(vlm)
    assert ours is not None
    image = picture(*size, seed=1)
    theirs = Idefics3ImageProcessorPil.from_pretrained(vlm)(image, return_row_col_info=True)
    processed = ours.preprocess(image)
    np.testing.assert_allclose(processed.pixel_values, theirs["pixel_values"][0], atol=1e-6)
    assert (processed.rows, processed.cols) == (theirs["rows"][0][0], theirs["cols"][0][0])
    assert ours.grid(*size) == (processed.rows, processed.cols)

    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(vlm / "tokenizer.json"))
    processor = transformers.Idefics3Processor(
        Idefics3ImageProcessorPil.from_pretrained(vlm), tokenizer, image_seq_len=ours.image_seq_len
    )
    expected = processor(text=["Look: <image> what?"], images=[[image]])["input_ids"][0]
    layout = prompt_string(processed.rows, processed.cols, ours.image_seq_len)
    assert tokenizer(f"Look: {layout} what?")["input_ids"] == expected


def test_logits_match_transformers_batched_with_text(
    vlm: Path, reference: transformers.Idefics3ForConditionalGeneration
) -> None:
    """Image and text-only requests in one batch, prefilled in chunks that cut through images."""
    engine = make_engine(vlm, max_num_batched_tokens=48)
    processor = Idefics3ImageProcessorPil.from_pretrained(vlm)
    prompts = {
        "one image": build_prompt(engine, [picture(100, 70, seed=2), "What is this?"]),
        "text only": build_prompt(engine, ["Tell me a story about a cat."]),
        "two images": build_prompt(
            engine, ["Compare", picture(30, 20, seed=3), "and", picture(60, 90, seed=4), "now."]
        ),
    }
    assert max(len(p.ids) for p in prompts.values()) > 48  # some image spans two chunks
    outcomes = run(engine, prompts)
    for name, prompt in prompts.items():
        outcome = outcomes[name]
        expected = reference_logprobs(reference, processor, prompt, outcome.tokens)
        assert expected.argmax(-1).tolist() == outcome.tokens, name
        chosen = expected[torch.arange(len(outcome.tokens)), torch.tensor(outcome.tokens)]
        torch.testing.assert_close(torch.tensor(outcome.logprobs), chosen, atol=1e-4, rtol=0)


def test_prefix_cache_is_keyed_by_image_content(vlm: Path) -> None:
    engine = make_engine(vlm)
    first = build_prompt(engine, ["Describe", picture(100, 70, seed=5), "briefly."])
    same = build_prompt(engine, ["Describe", picture(100, 70, seed=5), "briefly."])
    other = build_prompt(engine, ["Describe", picture(100, 70, seed=6), "briefly."])
    assert first.ids == other.ids  # the placeholders alone cannot tell the images apart
    image_start = first.images[0].start
    before = run(engine, {"first": first})["first"]
    again = run(engine, {"same": same})["same"]
    different = run(engine, {"other": other})["other"]
    block = engine.args.block_size
    assert again.cached >= first.images[0].end // block * block  # the image's blocks hit
    assert again.tokens == before.tokens
    assert again.logprobs == pytest.approx(before.logprobs, abs=1e-5)
    assert different.cached <= image_start  # only the text before the image is shared
    assert different.logprobs != pytest.approx(before.logprobs, abs=1e-3)


def test_an_image_that_does_not_fit_its_span_or_is_none_is_refused(vlm: Path) -> None:
    engine = make_engine(vlm)
    prompt = build_prompt(engine, ["See", picture(100, 70, seed=7)])
    image = prompt.images[0]
    short = WireImage(image.data, image.digest, image.start, image.end - 3)
    with pytest.raises(ValueError, match="image tokens"):
        engine.add_request("bad", prompt.ids, GREEDY, images=[short])
    outside = WireImage(image.data, image.digest, image.start, len(prompt.ids) + 1)
    with pytest.raises(ValueError, match="not in the prompt"):
        engine.add_request("bad", prompt.ids, GREEDY, images=[outside])
    garbage = WireImage(
        base64.b64encode(b"not an image").decode(), image.digest, image.start, image.end
    )
    with pytest.raises(ValueError, match="image 0 is not"):
        engine.add_request("bad", prompt.ids, GREEDY, images=[garbage])
    assert not engine.has_unfinished()


def test_the_offline_llm_takes_pictures_for_its_image_tokens(vlm: Path) -> None:
    llm = LLM(str(vlm), dtype="float32", max_model_len=2048, num_kv_blocks=256)
    pictured = picture(100, 70, seed=2)
    prompt = "<|im_start|>User:<image>What is this?<end_of_utterance>\nAssistant:"
    (by_picture,) = llm.generate([prompt], GREEDY, images=[[pictured]])
    (by_bytes,) = llm.generate([prompt], GREEDY, images=[[png(pictured)]])
    engine = make_engine(vlm)
    expected = run(engine, {"x": build_prompt(engine, [pictured, "What is this?"])})["x"]
    assert by_picture.token_ids == by_bytes.token_ids == expected.tokens
    assert by_picture.cached_tokens == 0 and by_bytes.cached_tokens > 0  # the same pixels
    with pytest.raises(ValueError, match="1 <image> tokens for 2 images"):
        llm.generate([prompt], GREEDY, images=[[pictured, pictured]])


SMOLVLM = Idefics3Processing.from_hf(  # SmolVLM-256M's: 512-pixel tiles, 2048 before tiling
    {"max_image_size": {"longest_edge": 512}, "size": {"longest_edge": 2048}}, 64
)


@pytest.mark.parametrize(
    "size", [(3000, 2100), (2100, 3000), (4000, 100), (2049, 2048), (2100, 1), (900, 600)]
)
def test_a_kept_picture_gives_the_tiles_of_the_whole_one(size: tuple[int, int]) -> None:
    """A picture waits for the encoder as preprocessing first resizes it: the same tiles."""
    whole = picture(*size, seed=8)
    kept = SMOLVLM.shrink(whole)
    assert kept.width * kept.height <= whole.width * whole.height
    if max(size) > SMOLVLM.longest_edge and min(size) > 1:
        assert max(kept.size) == SMOLVLM.longest_edge  # resized once, as preprocessing would
    expected, got = SMOLVLM.preprocess(whole), SMOLVLM.preprocess(kept)
    assert (got.rows, got.cols) == (expected.rows, expected.cols)
    assert np.array_equal(got.pixel_values, expected.pixel_values)


def test_a_picture_smaller_than_its_first_resize_is_kept_as_it_is() -> None:
    small = picture(300, 200, seed=9)
    assert SMOLVLM.shrink(small) is small  # upscaled only when its tiles are cut
    thin = picture(2100, 1, seed=9)  # resized, it would be resized again: kept whole
    assert SMOLVLM.shrink(thin) is thin


def test_the_engine_keeps_each_picture_shrunk_and_encodes_the_same_tiles(vlm: Path) -> None:
    engine = make_engine(vlm)
    processing = engine.image_processing
    assert processing is not None
    whole = picture(1000, 600, seed=10)
    prompt = build_prompt(engine, ["See", whole])
    image_id = engine.model_config.image_token_id
    assert image_id is not None
    vision = sequence_vision(
        prompt.images, prompt.ids, processing, image_id, processing.image_seq_len
    )
    (kept,) = vision.pictures
    assert max(kept.size) == processing.longest_edge < max(whole.size)
    expected = processing.preprocess(whole).pixel_values
    assert np.array_equal(vision.tiles().numpy(), expected)
