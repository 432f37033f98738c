"""Weight-only int8: the layer against dense arithmetic, the model against fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.model import quantized
from engine.model.layers import Linear
from engine.model.quantized import Int8Linear, QuantizedEmbedding, quantize_linears
from engine.setup import LoadedModel, resolve_dtype

CPU = torch.device("cpu")

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):",
    "The three primary colors are",
    "<|im_start|>user\nName a large animal.<|im_end|>\n<|im_start|>assistant\n",
]


def _random_linear(out_features: int, in_features: int, bias: bool) -> Linear:
    torch.manual_seed(0)
    layer = Linear(in_features, out_features, bias)
    layer.weight.data.normal_(0, 0.05)
    # One loud row per layer, as trained models have: its scale must not leak into others.
    layer.weight.data[3] *= 40
    if bias:
        layer.bias.data.normal_(0, 0.5)
    return layer


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, quantized.DENSE_FROM_ROWS, 150])
def test_int8_linear_matches_dense_arithmetic(rows: int, bias: bool) -> None:
    """Both the int8 kernel (few rows) and the dequantized GEMM (many) compute x·Wᵀ+b."""
    dense = _random_linear(96, 64, bias)
    layer = quantized.quantize(dense, "int8")
    assert layer.weight.dtype == torch.int8 and layer.scale.shape == (96,)

    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = layer(x).float()
    exact = F.linear(x.float(), dense.weight, dense.bias)
    dequantized = layer.weight.float() * layer.scale.float()[:, None]
    expected = F.linear(x.float(), dequantized, None if layer.bias is None else layer.bias.float())

    torch.testing.assert_close(got, expected, atol=0.05, rtol=0.02)
    # Per-row scales: the loud row does not coarsen the quiet ones.
    quiet = torch.ones(96, dtype=torch.bool)
    quiet[3] = False
    error = (got - exact)[:, quiet].abs().max()
    assert error < 0.05 * exact[:, quiet].abs().max(), error


def test_quantize_linears_replaces_every_projection(loaded_model: LoadedModel) -> None:
    """Every Linear (tied lm_head included) becomes int8; the embedding reads the head's rows."""
    model = loaded_model.model
    cfg = model.cfg
    small = type(model)(cfg, 64)
    small.load_state_dict(model.state_dict())
    embedding = small.embed_tokens.weight.clone()

    chosen = quantize_linears(small, "int8")

    assert not [name for name, m in small.named_modules() if isinstance(m, Linear)]
    int8 = [m for m in small.modules() if isinstance(m, Int8Linear)]
    assert len(int8) == len(chosen) == 4 * cfg.num_layers + 1
    assert isinstance(small.embed_tokens, QuantizedEmbedding)
    ids = torch.tensor([0, 7, cfg.vocab_size - 1])
    rows = small.embed_tokens(ids).float()
    torch.testing.assert_close(
        rows, embedding[ids], atol=embedding.abs().max().item() / 127, rtol=0
    )


def test_quantized_default_model_follows_fp32(loaded_model: LoadedModel) -> None:
    """The int8 model's first choice is fp32's, or within a hair of it, for every prompt."""
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=20)
    encode = loaded_model.tokenizer.tokenizer.encode
    prompts = [encode(p).ids for p in PROMPTS]
    int8 = LLM(quantization="int8", dtype="auto", max_model_len=256, num_kv_blocks=64)
    assert int8.engine.precision.dtype == torch.bfloat16
    fp32 = LLM(max_model_len=256, num_kv_blocks=64)

    ours, reference = int8.generate(prompts, params), fp32.generate(prompts, params)

    assert "Paris" in ours[0].text, ours[0].text
    same_first = 0
    for got, want in zip(ours, reference, strict=True):
        first = got.logprobs[0]
        alternatives = dict(first.top)
        wanted = want.token_ids[0]
        assert wanted in alternatives, (want.text, got.text)
        assert first.logprob - alternatives[wanted] < 0.5, (want.text, got.text)
        same_first += got.token_ids[0] == wanted
    assert same_first >= len(PROMPTS) - 1


def test_quantization_is_checked_before_loading() -> None:
    with pytest.raises(ValueError, match="'int3' is not supported; use one of int8, int4"):
        resolve_dtype("auto", CPU, "int3")
    with pytest.raises(ValueError, match="computes in bfloat16"):
        resolve_dtype("float32", CPU, "int8")
    with pytest.raises(ValueError, match="runs on CPU only"):
        resolve_dtype("auto", torch.device("cuda"), "int8")
    assert resolve_dtype("auto", CPU, "int8") is torch.bfloat16
