"""The Llama family (Llama, Mistral, Qwen2, Qwen3) on flattened tokens.

There is no batch dimension and no padding: the runner lays every scheduled
token end to end, and the attention backend knows which belong together.
Q/K/V and gate/up projections are fused into one matmul each.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.attention import AttentionBackend
from engine.config import ModelConfig
from engine.model.layers import Linear, RMSNorm, RotaryEmbedding, rotate, silu_mul

Rope = tuple[torch.Tensor, torch.Tensor]  # cos and sin rows of this step's positions
# Rows of this step's tokens, and the embeddings that replace theirs (an image's features).
Placed = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: Rope, attention: AttentionBackend) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat(
                (self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), 1
            )
        qk = rotate(qk, rope)  # queries and keys share positions: one rotation for both
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = attention.forward(self.layer, q, k, v)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: Rope, attention: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        rows: torch.Tensor | None = None,
        placed: Placed | None = None,
    ) -> torch.Tensor:
        """Final (normed) hidden states ``[len(rows), hidden]``: only the positions read out
        (every one when ``rows`` is None).

        ``placed`` replaces the embeddings of some tokens (an image's placeholders).
        """
        x = self.embed_tokens(input_ids)
        if placed is not None:
            x = x.index_copy(0, placed[0], placed[1].to(x.dtype))
        rope = self.rotary.lookup(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, attention)
        return self.norm(x if rows is None else x[rows])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` for hidden states from ``forward``."""
        return self.lm_head(hidden).float()

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up on the way.

        Each parameter is looked up when its tensor comes, and none is held
        across tensors, so a layer the caller replaces between two tensors (a
        quantized one) is freed at once.
        """
        names = {name for name, _ in self.named_parameters()}
        loaded: set[str] = set()
        for hf_name, tensor in tensors:
            name = hf_name.removeprefix("model.")
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            name, rows = self.target(name)
            if name not in names:
                raise KeyError(f"tensor {hf_name!r} has no place in {self.cfg.architecture}")
            self.get_parameter(name).data[rows].copy_(tensor)
            loaded.add(name)
        missing = sorted(names - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")

    def target(self, name: str) -> tuple[str, slice]:
        """Our parameter for an HF tensor name, and the rows the tensor fills."""
        cfg = self.cfg
        q, kv, inter = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
            cfg.intermediate_size,
        )
        shards = {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, inter),
            "up_proj": ("gate_up_proj", inter, inter),
        }
        for part, (fused, start, size) in shards.items():
            if f".{part}." in name:
                return name.replace(part, fused), slice(start, start + size)
        return name, slice(None)
