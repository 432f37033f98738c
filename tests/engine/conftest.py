"""Shared engine fixtures: the default model loaded once, fresh KV caches per engine.

Loading the weights takes seconds; a KV cache takes milliseconds. So the model
is loaded once per session and every test builds its engines on it, each with
a cache of its own: two engines on one cache would overwrite each other's
prefix-cached blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.attention import KVCache, make_backend
from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.setup import LoadedModel, load_engine_model

MAX_MODEL_LEN = 512
DEFAULT_BLOCKS = 256  # 4,096 token slots: every test's requests at once, with room to spare

EngineFactory = Callable[..., LLMEngine]


def _load(**args: Any) -> LoadedModel:
    # CI machines have two cores shared with parallel jobs; OpenMP threads that
    # spin-wait there make each small op ~100x slower than one plain thread.
    torch.set_num_threads(1)
    # The cache allocated here is never used: make_engine gives each engine its own.
    return load_engine_model(EngineArgs(max_model_len=MAX_MODEL_LEN, num_kv_blocks=1, **args))


@pytest.fixture(scope="session")
def loaded_model() -> LoadedModel:
    """The default model in the default precision."""
    return _load()


@pytest.fixture(scope="session")
def loaded_float32_model() -> LoadedModel:
    """The default model in float32, for the tests that compare with transformers."""
    return _load(dtype="float32")


@pytest.fixture
def make_engine(loaded_model: LoadedModel) -> EngineFactory:
    """``make_engine(num_blocks=..., **engine_args)``: an engine with a fresh KV cache."""
    return _factory(loaded_model)


@pytest.fixture
def make_float32_engine(loaded_float32_model: LoadedModel) -> EngineFactory:
    """``make_engine`` on the float32 model."""
    return _factory(loaded_float32_model)


def _factory(loaded_model: LoadedModel) -> EngineFactory:
    def build(num_blocks: int = DEFAULT_BLOCKS, **engine_args: Any) -> LLMEngine:
        cfg = loaded_model.model.cfg
        args = EngineArgs(max_model_len=MAX_MODEL_LEN, num_kv_blocks=num_blocks, **engine_args)
        cache = KVCache.allocate(
            cfg.num_layers,
            num_blocks,
            args.block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            loaded_model.precision.kv_dtype,
            loaded_model.device,
        )
        loaded = dataclasses.replace(
            loaded_model,
            attention=make_backend(cache, loaded_model.device),
            num_blocks=num_blocks,
            max_model_len=min(MAX_MODEL_LEN, num_blocks * args.block_size),
        )
        return LLMEngine(args, loaded)

    return build
