"""Our model against Hugging Face transformers, the reference implementation.

Small random-weight models of each supported architecture go through the real
save → load path; the default model is compared on greedy decoding.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.attention import BatchLayout, KVCache, make_backend
from engine.config import ModelConfig
from engine.loader import load_checkpoint
from engine.model.llama import LlamaForCausalLM

BLOCK = 16

ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama3-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "llama-linear-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "tie_word_embeddings": True},
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        {"sliding_window": None},
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 24}),
}


def _save_random_model(kind: str, path: Path) -> transformers.PreTrainedModel:
    config_cls, model_cls, extra = ARCHITECTURES[kind]
    config = config_cls(
        vocab_size=320,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        **extra,
    )
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # random norms too, so a missed norm weight shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return model


def _run_ours(path: Path, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill all prompts in one flattened batch, then one batched decode step."""
    checkpoint = load_checkpoint(path)
    cfg = ModelConfig.from_hf(checkpoint.config)
    model = LlamaForCausalLM(cfg, 256)
    model.load_weights(checkpoint.tensors)
    cache = KVCache.allocate(
        cfg.num_layers,
        64,
        BLOCK,
        cfg.num_kv_heads,
        cfg.head_dim,
        torch.float32,
        torch.device("cpu"),
    )
    backend = make_backend(cache, torch.device("cpu"))
    tables = [[4 * i + j for j in range(4)] for i in range(len(prompts))]

    def slots(i: int, positions: range) -> list[int]:
        return [tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in positions]

    ids = [t for p in prompts for t in p]
    positions = [p for prompt in prompts for p in range(len(prompt))]
    slot_mapping = [s for i, p in enumerate(prompts) for s in slots(i, range(len(p)))]
    lens = [len(p) for p in prompts]
    backend.plan(BatchLayout(lens, lens, tables, torch.tensor(slot_mapping)))
    last = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(len(lens))])
    with torch.inference_mode():
        prefill = model.compute_logits(
            model(torch.tensor(ids), torch.tensor(positions), backend, last)
        )
        next_ids = prefill.argmax(-1)
        decode_slots = [slots(i, range(n, n + 1))[0] for i, n in enumerate(lens)]
        backend.plan(
            BatchLayout([1] * len(lens), [n + 1 for n in lens], tables, torch.tensor(decode_slots))
        )
        decode = model.compute_logits(
            model(next_ids, torch.tensor(lens), backend, torch.arange(len(lens)))
        )
    return prefill, decode


@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_random_model_logits_match_transformers(kind: str, tmp_path: Path) -> None:
    reference = _save_random_model(kind, tmp_path)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=generator).tolist() for n in (5, 17, 40, 1)]
    prefill, decode = _run_ours(tmp_path, prompts)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt])).logits[0, -1]
            extended = prompt + [int(prefill[i].argmax())]
            next_logits = reference(torch.tensor([extended])).logits[0, -1]
        torch.testing.assert_close(prefill[i], logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(decode[i], next_logits, atol=1e-4, rtol=0)


PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def quicksort(items):",
    "Once upon a time, in a land far away,",
    "The three primary colors are",
    "<|im_start|>user\nExplain photosynthesis in one paragraph.<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 5, 8, 13,",
    "Translate to French: The cat sleeps on the warm windowsill.",
]


@pytest.mark.slow
def test_default_model_greedy_matches_transformers(transformers_default) -> None:
    llm = LLM("default", dtype="float32", max_num_seqs=8)
    prompt_ids = [llm.tokenizer.tokenizer.encode(p).ids for p in PROMPTS]
    ours = llm.generate(prompt_ids, SamplingParams(max_tokens=64, min_tokens=64, temperature=0))
    reference = transformers_default
    eos = reference.generation_config.eos_token_id
    for ids, output in zip(prompt_ids, ours, strict=True):
        # Greedy decoding is a function of the prefix, so one teacher-forced
        # pass over our output checks every step that transformers' own
        # ``generate`` would take (64 of its decode steps cost 5 s).
        with torch.no_grad():
            logits = reference(torch.tensor([ids + output.token_ids[:-1]])).logits[
                0, len(ids) - 1 :
            ]
        logits[:, eos] = float("-inf")  # min_tokens: no end before the 64th token
        assert logits.argmax(-1).tolist() == output.token_ids


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
