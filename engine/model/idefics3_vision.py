"""Idefics3's vision side: a SigLIP encoder over square tiles and the connector into text space.

Each tile is cut into ``patch_size`` patches, encoded by a bidirectional
transformer, and shrunk by the connector's pixel shuffle (``scale_factor``
squared neighbouring patches become one token) before a projection to the
text model's width. Preprocessing always yields whole tiles (``S x S``), so
no patch is padding and every tile attends to all of its patches.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    scale_factor: int
    text_hidden_size: int

    @classmethod
    def from_hf(cls, full: dict[str, Any]) -> VisionConfig:
        """From an Idefics3 ``config.json``: its ``vision_config`` and the connector's fields."""
        vision = full["vision_config"]
        activation = vision.get("hidden_act", "gelu_pytorch_tanh")
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"vision activation {activation!r} is not supported")
        return cls(
            hidden_size=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"],
            num_hidden_layers=vision["num_hidden_layers"],
            num_attention_heads=vision["num_attention_heads"],
            image_size=vision["image_size"],
            patch_size=vision["patch_size"],
            layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
            scale_factor=full.get("scale_factor", 2),
            text_hidden_size=full["text_config"]["hidden_size"],
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class Embeddings(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, cfg.hidden_size, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.patches_per_side**2, cfg.hidden_size)
        self.register_buffer("position_ids", _position_ids(cfg.patches_per_side), persistent=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return patches + self.position_embedding(self.position_ids)


def _position_ids(side: int) -> torch.Tensor:
    """Each patch's bucket on the grid, computed in float32 as the checkpoint was trained.

    A whole tile's patches land in their own buckets; the fractional form is
    kept so that any rounding in it rounds the same way here.
    """
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    step = 1.0 / torch.tensor(side)
    fractions = (torch.arange(side, dtype=torch.float32) * step).clamp(max=1.0 - 1e-6)
    buckets = torch.bucketize(fractions, boundaries, right=True)
    return (buckets[:, None] * side + buckets[None, :]).reshape(-1)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        width = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.layer_norm1 = nn.LayerNorm(width, eps=cfg.layer_norm_eps)
        self.layer_norm2 = nn.LayerNorm(width, eps=cfg.layer_norm_eps)
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)
        self.fc1 = nn.Linear(width, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles, patches, width = x.shape
        h = self.layer_norm1(x)

        def heads(projection: nn.Linear) -> torch.Tensor:
            return projection(h).view(tiles, patches, self.heads, -1).transpose(1, 2)

        attended = F.scaled_dot_product_attention(
            heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        )
        x = x + self.out_proj(attended.transpose(1, 2).reshape(tiles, patches, width))
        return x + self.fc2(F.gelu(self.fc1(self.layer_norm2(x)), approximate="tanh"))


class Idefics3Vision(nn.Module):
    """Tiles ``[n, 3, S, S]`` to text-space features ``[n, tokens_per_tile, text_hidden]``."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        shuffled = cfg.hidden_size * cfg.scale_factor**2
        self.proj = nn.Linear(shuffled, cfg.text_hidden_size, bias=False)

    @property
    def tokens_per_tile(self) -> int:
        return self.cfg.patches_per_side**2 // self.cfg.scale_factor**2

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.layers:
            x = layer(x)
        return self.proj(self._pixel_shuffle(self.post_layernorm(x)))

    def _pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """Fold each ``scale x scale`` block of patches into one token, row-major as trained."""
        tiles, patches, width = x.shape
        side, scale = self.cfg.patches_per_side, self.cfg.scale_factor
        x = x.view(tiles, side, side // scale, width * scale).permute(0, 2, 1, 3)
        x = x.reshape(tiles, side // scale, side // scale, width * scale * scale)
        return x.permute(0, 2, 1, 3).reshape(tiles, patches // scale**2, width * scale**2)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names under ``vision_model.`` and ``connector.`` (with or without ``model.``)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in tensors:
            name = _local_name(hf_name.removeprefix("model."))
            if name not in params:
                raise KeyError(f"unexpected vision weight {hf_name!r}")
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise KeyError(f"vision weights missing from the checkpoint: {missing[:5]}")


def _local_name(name: str) -> str:
    """An HF vision weight's name in this module."""
    name = name.replace("connector.modality_projection.proj.", "proj.")
    name = name.replace("vision_model.encoder.layers.", "layers.")
    name = name.replace("vision_model.", "")
    return name.replace(".self_attn.", ".").replace(".mlp.", ".")
