"""Checkpoint loading: the default GGUF, hand-made GGUFs of every supported type, HF dirs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from engine.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedArchitecture
from engine.loader import Checkpoint, load_checkpoint
from engine.loader.gguf import llama3_scaling_from_factors, unpermute_rows
from engine.model.llama import LlamaForCausalLM
from engine.precision import stored_methods
from engine.setup import layer_bits
from shared.registry import smollm2_gguf_path

Q = GGMLQuantizationType


# --- the default model --------------------------------------------------------


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    return smollm2_gguf_path()


@pytest.fixture(scope="module")
def default_checkpoint(default_gguf: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    checkpoint = load_checkpoint(default_gguf)
    return checkpoint.config, dict(checkpoint.tensors)


def test_default_gguf_config(default_checkpoint):
    config, _ = default_checkpoint
    model = ModelConfig.from_hf(config)
    assert model.architecture == "LlamaForCausalLM"
    assert (model.vocab_size, model.hidden_size, model.intermediate_size) == (49152, 576, 1536)
    assert (model.num_layers, model.num_heads, model.num_kv_heads, model.head_dim) == (30, 9, 3, 64)
    assert model.rope_theta == 100000.0
    assert model.max_position_embeddings == 8192
    assert model.rms_norm_eps == pytest.approx(1e-5)
    assert model.tie_word_embeddings
    assert model.rope_scaling is None


def test_default_gguf_tensors_have_hf_names_and_shapes(default_checkpoint):
    config, tensors = default_checkpoint
    hidden, ffn, kv = 576, 1536, 3 * 64
    expected = {"model.embed_tokens.weight": (49152, hidden), "model.norm.weight": (hidden,)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        expected |= {
            prefix + "self_attn.q_proj.weight": (hidden, hidden),
            prefix + "self_attn.k_proj.weight": (kv, hidden),
            prefix + "self_attn.v_proj.weight": (kv, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, hidden),
            prefix + "mlp.gate_proj.weight": (ffn, hidden),
            prefix + "mlp.up_proj.weight": (ffn, hidden),
            prefix + "mlp.down_proj.weight": (hidden, ffn),
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
        }
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors.values())
    assert "lm_head.weight" not in tensors  # tied


def test_default_gguf_streams_lazily_in_requested_dtype(default_gguf):
    checkpoint = load_checkpoint(default_gguf, dtype=torch.bfloat16)
    assert iter(checkpoint.tensors) is checkpoint.tensors
    name, tensor = next(checkpoint.tensors)
    assert name == "model.embed_tokens.weight"
    assert tensor.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def transformers_state_dict(transformers_default) -> dict[str, torch.Tensor]:
    """What transformers makes of the same GGUF."""
    return transformers_default.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("projection", ["q_proj", "k_proj"])
def test_unpermuted_projection_matches_transformers(
    default_checkpoint, transformers_state_dict, projection
):
    _, tensors = default_checkpoint
    name = f"model.layers.0.self_attn.{projection}.weight"
    torch.testing.assert_close(tensors[name], transformers_state_dict[name], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_every_tensor_matches_transformers(default_checkpoint, transformers_state_dict):
    _, tensors = default_checkpoint
    for name, tensor in tensors.items():
        difference = (tensor - transformers_state_dict[name]).abs().max().item()
        assert difference <= 1e-6, f"{name}: off by {difference}"


# --- un-permutation -------------------------------------------------------------


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf's ``permute``, as the converter writes Q and K."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.mark.parametrize(("n_head", "n_head_kv", "head_dim"), [(4, 4, 8), (9, 3, 64), (8, 2, 16)])
def test_unpermute_inverts_llama_cpp_permute(n_head, n_head_kv, head_dim):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((n_head * head_dim, 12)).astype(np.float32)
    k = rng.standard_normal((n_head_kv * head_dim, 12)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rows(llama_cpp_permute(q, n_head, n_head), n_head), q)
    np.testing.assert_array_equal(
        unpermute_rows(llama_cpp_permute(k, n_head, n_head_kv), n_head_kv), k
    )
    bias = rng.standard_normal(n_head * head_dim).astype(np.float32)
    np.testing.assert_array_equal(
        unpermute_rows(llama_cpp_permute(bias, n_head, n_head), n_head), bias
    )


# --- hand-made GGUFs ------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 256, 4, 2, 64, 64, 8


def write_llama_gguf(
    path: Path, tensors: dict[str, tuple[np.ndarray, Q | None]], *, arch: str = "llama", **extra
) -> Path:
    """A GGUF with llama metadata; each tensor is float data or raw blocks with their type."""
    writer = GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", 1)
    writer.add_uint32(f"{arch}.context_length", 2048)
    writer.add_uint32(f"{arch}.embedding_length", HIDDEN)
    writer.add_uint32(f"{arch}.feed_forward_length", FFN)
    writer.add_uint32(f"{arch}.attention.head_count", HEADS)
    writer.add_uint32(f"{arch}.attention.head_count_kv", KV_HEADS)
    writer.add_uint32(f"{arch}.rope.dimension_count", HEAD_DIM)
    writer.add_uint32(f"{arch}.vocab_size", VOCAB)
    writer.add_float32(f"{arch}.rope.freq_base", 500000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    for key, value in extra.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_float32(key, value)
    for name, (data, raw_type) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_q4_k_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q4_K rows with finite scales: d, dmin (f16), 12 packed scale bytes, 128 nibbles."""
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, size=(blocks.shape[0], 2)).astype(np.float16)
    blocks[:, :4] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def random_q6_k_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q6_K rows: 128 low nibbles, 64 high-bit bytes, 16 int8 scales, d (f16)."""
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 210), dtype=np.uint8)
    d = rng.uniform(0.001, 0.01, size=(blocks.shape[0], 1)).astype(np.float16)
    blocks[:, 208:] = d.view(np.uint8)
    return blocks.reshape(rows, -1)


def reference_q4_k(block: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_q4_K, element by element."""
    d, dmin = (float(v) for v in block[:4].view(np.float16))
    scales, qs = block[4:16].astype(int), block[16:].astype(int)

    def scale_min(j: int) -> tuple[int, int]:
        if j < 4:
            return scales[j] & 63, scales[j + 4] & 63
        return (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4), (scales[j + 4] >> 4) | (
            (scales[j] >> 6) << 4
        )

    out = []
    for chunk in range(4):
        q = qs[chunk * 32 : chunk * 32 + 32]
        (sc1, m1), (sc2, m2) = scale_min(2 * chunk), scale_min(2 * chunk + 1)
        out += [d * sc1 * (v & 0xF) - dmin * m1 for v in q]
        out += [d * sc2 * (v >> 4) - dmin * m2 for v in q]
    return np.asarray(out, dtype=np.float32)


def reference_q6_k(block: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_q6_K, element by element."""
    ql, qh = block[:128].astype(int), block[128:192].astype(int)
    scales = block[192:208].view(np.int8).astype(int)
    d = float(block[208:210].view(np.float16)[0])
    out = np.zeros(256, dtype=np.float32)
    for half in range(2):
        lo, hi, sc, y = ql[64 * half :], qh[32 * half :], scales[8 * half :], 128 * half
        for i in range(32):
            s = i // 16
            low = (lo[i] & 0xF, lo[i + 32] & 0xF, lo[i] >> 4, lo[i + 32] >> 4)
            for quarter in range(4):
                q = (low[quarter] | (((hi[i] >> (2 * quarter)) & 3) << 4)) - 32
                out[y + i + 32 * quarter] = d * sc[s + 2 * quarter] * q
    return out


def reference_rows(raw: np.ndarray, reference, block_bytes: int) -> np.ndarray:
    blocks = raw.reshape(-1, block_bytes)
    return np.concatenate([reference(b) for b in blocks]).reshape(raw.shape[0], -1)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> tuple[Path, dict[str, tuple[np.ndarray, float]]]:
    """One tiny llama layer with every supported tensor type.

    Returns the file and, per HF tensor, the values it must hold *in file row
    order* with the allowed absolute error. Q and K are compared after putting
    the loaded rows back into llama.cpp's order, so the check of the
    un-permutation does not rely on the loader's own code.
    """
    rng = np.random.default_rng(1)

    def floats(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    embed, v, o, gate, up, down, out = (
        floats(VOCAB, HIDDEN),
        floats(KV_HEADS * HEAD_DIM, HIDDEN),
        floats(HIDDEN, HIDDEN),
        floats(FFN, HIDDEN),
        floats(FFN, HIDDEN),
        floats(HIDDEN, FFN),
        floats(VOCAB, HIDDEN),
    )
    norm = floats(HIDDEN)
    q_raw = random_q4_k_blocks(rng, HIDDEN, HIDDEN)
    k_raw = random_q6_k_blocks(rng, KV_HEADS * HEAD_DIM, HIDDEN)
    tensors = {
        "token_embd.weight": (embed.astype(np.float16), None),
        "blk.0.attn_q.weight": (q_raw, Q.Q4_K),
        "blk.0.attn_k.weight": (k_raw, Q.Q6_K),
        "blk.0.attn_v.weight": (quantize(v, Q.Q8_0), Q.Q8_0),
        "blk.0.attn_output.weight": (quantize(o, Q.Q4_0), Q.Q4_0),
        "blk.0.ffn_gate.weight": (quantize(gate, Q.Q4_1), Q.Q4_1),
        "blk.0.ffn_up.weight": (quantize(up, Q.BF16), Q.BF16),
        "blk.0.ffn_down.weight": (down, None),
        "blk.0.attn_norm.weight": (norm, None),
        "blk.0.ffn_norm.weight": (norm, None),
        "output_norm.weight": (norm, None),
        "output.weight": (quantize(out, Q.Q8_0), Q.Q8_0),
    }
    path = write_llama_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf", tensors)
    q_ref = reference_rows(q_raw, reference_q4_k, 144)
    k_ref = reference_rows(k_raw, reference_q6_k, 210)
    expected = {
        "model.embed_tokens.weight": (embed.astype(np.float16).astype(np.float32), 0.0),
        "model.layers.0.self_attn.q_proj.weight": (q_ref, 1e-6),
        "model.layers.0.self_attn.k_proj.weight": (k_ref, 1e-6),
        # block quantization error: at most half a step of each block's scale
        "model.layers.0.self_attn.v_proj.weight": (v, np.abs(v).max() / 127),
        "model.layers.0.self_attn.o_proj.weight": (o, np.abs(o).max() / 8),
        "model.layers.0.mlp.gate_proj.weight": (gate, np.ptp(gate) / 15),
        "model.layers.0.mlp.up_proj.weight": (up, np.abs(up).max() / 128),
        "model.layers.0.mlp.down_proj.weight": (down, 0.0),
        "model.layers.0.input_layernorm.weight": (norm, 0.0),
        "model.layers.0.post_attention_layernorm.weight": (norm, 0.0),
        "model.norm.weight": (norm, 0.0),
        "lm_head.weight": (out, np.abs(out).max() / 127),
    }
    return path, expected


def _in_file_order(name: str, tensor: torch.Tensor) -> np.ndarray:
    values = tensor.numpy()
    if name.endswith("q_proj.weight"):
        return llama_cpp_permute(values, HEADS, HEADS)
    if name.endswith("k_proj.weight"):
        return llama_cpp_permute(values, HEADS, KV_HEADS)
    return values


def test_every_quant_type_dequantizes_to_reference(mixed_gguf):
    path, expected = mixed_gguf
    tensors = dict(load_checkpoint(path).tensors)
    assert tensors.keys() == expected.keys()
    for name, (values, atol) in expected.items():
        np.testing.assert_allclose(
            _in_file_order(name, tensors[name]), values, rtol=0, atol=atol, err_msg=name
        )


def test_bf16_is_exact_round_to_nearest(mixed_gguf):
    """BF16 in the file is read back bit for bit (torch's rounding of the same floats)."""
    path, expected = mixed_gguf
    tensors = dict(load_checkpoint(path).tensors)
    up = torch.from_numpy(expected["model.layers.0.mlp.up_proj.weight"][0])
    assert torch.equal(tensors["model.layers.0.mlp.up_proj.weight"], up.bfloat16().float())


def test_stored_widths_decide_which_layers_stay_quantized(mixed_gguf):
    """Each tensor's bits per weight; a fused layer takes the widest of its parts."""
    path, _ = mixed_gguf
    checkpoint = load_checkpoint(path)
    bits = {name.split(".")[-2]: width for name, width in checkpoint.stored_bits.items()}
    assert bits == {
        "embed_tokens": None,  # F16
        "q_proj": 4.5,  # Q4_K
        "k_proj": 6.5625,  # Q6_K
        "v_proj": 8.5,  # Q8_0
        "o_proj": 4.5,  # Q4_0
        "gate_proj": 5.0,  # Q4_1
        "up_proj": None,  # BF16
        "down_proj": None,  # F32
        "input_layernorm": None,
        "post_attention_layernorm": None,
        "norm": None,
        "lm_head": 8.5,  # Q8_0
    }
    model = LlamaForCausalLM(ModelConfig.from_hf(checkpoint.config), 64)
    methods = stored_methods(layer_bits(model, checkpoint.stored_bits))
    assert methods == {
        "layers.0.self_attn.qkv_proj": "int8",
        "layers.0.self_attn.o_proj": "int4",
        "lm_head": "int8",
    }


def test_untied_gguf_config(mixed_gguf):
    path, _ = mixed_gguf
    config = load_checkpoint(path).config
    assert config["tie_word_embeddings"] is False
    assert config["rope_theta"] == 500000.0
    assert config["max_position_embeddings"] == 2048
    assert ModelConfig.from_hf(config).num_kv_heads == KV_HEADS


def _minimal_tensors() -> dict[str, tuple[np.ndarray, Q | None]]:
    return {
        "token_embd.weight": (np.zeros((VOCAB, HIDDEN), np.float32), None),
        "output_norm.weight": (np.ones(HIDDEN, np.float32), None),
    }


def test_unsupported_gguf_architecture_lists_supported(tmp_path):
    path = write_llama_gguf(tmp_path / "phi.gguf", _minimal_tensors(), arch="phi3")
    with pytest.raises(ValueError, match=r"'phi3' is not supported; supported: llama"):
        load_checkpoint(path)


def test_moe_tensors_are_rejected_at_load(tmp_path):
    tensors = _minimal_tensors()
    tensors["blk.0.ffn_gate_exps.weight"] = (np.zeros((2, 4, HIDDEN), np.float32), None)
    path = write_llama_gguf(tmp_path / "moe.gguf", tensors)
    with pytest.raises(ValueError, match="ffn_gate_exps"):
        load_checkpoint(path)


def llama3_factors(head_dim: int, theta: float, factor: float) -> np.ndarray:
    """What llama.cpp's converter writes as rope_freqs for Llama 3.1 (low 1, high 4, 8192)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2) / head_dim))
    wavelengths = 2 * np.pi / freqs
    smooth = (8192 / wavelengths - 1) / (4 - 1)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelengths < 8192 / 4, 1.0, np.where(wavelengths > 8192, factor, mid)).astype(
        np.float32
    )


def test_rope_freqs_tensor_becomes_llama3_scaling(tmp_path):
    tensors = _minimal_tensors()
    tensors["rope_freqs.weight"] = (llama3_factors(HEAD_DIM, 500000.0, 8.0), None)
    checkpoint = load_checkpoint(write_llama_gguf(tmp_path / "l31.gguf", tensors))
    scaling = ModelConfig.from_hf(checkpoint.config).rope_scaling
    assert scaling is not None
    assert (scaling.kind, scaling.factor, scaling.low_freq_factor) == ("llama3", 8.0, 1.0)
    assert (scaling.high_freq_factor, scaling.original_max_position_embeddings) == (4.0, 8192)
    assert "rope_freqs.weight" not in dict(checkpoint.tensors)


def test_rope_freqs_of_another_scaling_is_rejected():
    factors = llama3_factors(HEAD_DIM, 500000.0, 8.0) ** 0.5
    with pytest.raises(ValueError, match="rope_freqs"):
        llama3_scaling_from_factors(factors, HEAD_DIM, 500000.0)
    assert llama3_scaling_from_factors(np.ones(HEAD_DIM // 2), HEAD_DIM, 1e4) is None


def test_linear_rope_scaling_keys(tmp_path):
    path = write_llama_gguf(
        tmp_path / "linear.gguf",
        _minimal_tensors(),
        **{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
    )
    scaling = ModelConfig.from_hf(load_checkpoint(path).config).rope_scaling
    assert scaling is not None and (scaling.kind, scaling.factor) == ("linear", 4.0)


# --- HF directories ---------------------------------------------------------------


def _tiny_hf_model(architecture: str, tmp_path: Path) -> dict[str, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    model_class = getattr(transformers, architecture)
    torch.manual_seed(0)
    model = model_class(config_class(**common))
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="50KB")
    return model.state_dict()


@pytest.mark.parametrize(
    "architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
)
def test_hf_dir_matches_state_dict(architecture, tmp_path):
    state = _tiny_hf_model(architecture, tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file(), "expected a sharded save"
    checkpoint = load_checkpoint(tmp_path)
    assert isinstance(checkpoint, Checkpoint)
    assert ModelConfig.from_hf(checkpoint.config).architecture == architecture
    tensors = dict(checkpoint.tensors)
    assert tensors.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(tensors[name], tensor), name
    if architecture == "Qwen2ForCausalLM":
        assert "model.layers.0.self_attn.q_proj.bias" in tensors
    if architecture == "Qwen3ForCausalLM":
        assert "model.layers.0.self_attn.q_norm.weight" in tensors


def test_hf_dir_casts_and_drops_tied_head_and_buffers(tmp_path):
    from safetensors.torch import save_file

    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 4,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    embed = torch.randn(4, 8)
    save_file(
        {
            "model.embed_tokens.weight": embed,
            "lm_head.weight": embed.clone(),
            "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2),
        },
        str(tmp_path / "model.safetensors"),
    )
    tensors = dict(load_checkpoint(tmp_path, dtype=torch.float16).tensors)
    assert list(tensors) == ["model.embed_tokens.weight"]
    assert torch.equal(tensors["model.embed_tokens.weight"], embed.half())


def test_hf_dir_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "num_attention_heads": 2})
    )
    with pytest.raises(UnsupportedArchitecture) as error:
        load_checkpoint(tmp_path)
    assert "GPT2LMHeadModel" in str(error.value)
    for supported in SUPPORTED_ARCHITECTURES:
        assert supported in str(error.value)


def test_missing_or_unknown_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"\.gguf"):
        load_checkpoint(tmp_path / "weights.bin")
