"""Idefics3 (SmolVLM): a Llama text model whose image tokens take a vision encoder's features.

The text model runs exactly as a text-only one; an image's ``<image>``
placeholder tokens enter it with the encoder's features instead of their
embeddings (``placed``). The encoder runs once per image, when the first
chunk that needs its features is computed (``engine.vision``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.attention import AttentionBackend
from engine.config import ModelConfig
from engine.model.idefics3_vision import Idefics3Vision, VisionConfig
from engine.model.llama import LlamaForCausalLM, Placed

_VISION_PREFIXES = ("model.vision_model.", "model.connector.", "vision_model.", "connector.")
_TEXT_PREFIXES = ("model.text_model.", "text_model.")


class Idefics3ForConditionalGeneration(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        assert cfg.vision is not None and cfg.image_token_id is not None
        self.cfg = cfg
        self.text = LlamaForCausalLM(cfg, max_positions)
        self.vision = Idefics3Vision(VisionConfig.from_hf(cfg.vision))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        rows: torch.Tensor,
        placed: Placed | None = None,
    ) -> torch.Tensor:
        return self.text(input_ids, positions, attention, rows, placed)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.text.compute_logits(hidden)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Features ``[tiles * tokens_per_tile, hidden]``, in the order of the image tokens."""
        dtype = self.text.norm.weight.dtype  # the embedding may be quantized
        features = self.vision(pixel_values.to(dtype))
        return features.reshape(-1, features.shape[-1])

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names: the text model's under ``model.text_model.``, the rest the encoder's."""
        vision: list[tuple[str, torch.Tensor]] = []

        def text() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in tensors:
                if name.startswith(_VISION_PREFIXES):
                    vision.append((name, tensor))
                    continue
                for prefix in _TEXT_PREFIXES:
                    name = name.removeprefix(prefix)
                yield name, tensor

        self.text.load_weights(text())
        self.vision.load_weights(vision)
