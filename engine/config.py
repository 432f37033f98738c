"""Engine and model configuration.

``EngineArgs`` is the one set of knobs every entry shares (offline ``LLM``,
``sluice serve``, ``sluice worker``). ``ModelConfig`` is the architecture as
the model code needs it, read from an HF ``config.json``-style dict whichever
file format the weights came in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shared.engine_options import EngineOptions
from shared.execution import default_enforce_eager
from shared.images.loading import VISION_ARCHITECTURES
from shared.precision import default_dtype

if TYPE_CHECKING:
    from shared.registry import ModelSpec

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *VISION_ARCHITECTURES,
)


class UnsupportedArchitecture(ValueError):
    pass


@dataclass(slots=True)
class RopeScaling:
    kind: str  # "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k
    rope_scaling: RopeScaling | None = None
    # A vision-language model's whole HF config (its vision part is the vision module's to
    # read) and the id of its image token; None for a text model.
    vision: dict[str, Any] | None = None
    image_token_id: int | None = None

    @classmethod
    def from_hf(cls, full: dict[str, Any]) -> ModelConfig:
        """From ``config.json``; a vision-language model's text part is its ``text_config``."""
        architecture = (full.get("architectures") or ["LlamaForCausalLM"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitecture(
                f"architecture {architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        vision = architecture in VISION_ARCHITECTURES
        cfg = full["text_config"] if vision else full
        num_heads = cfg["num_attention_heads"]
        tied = full.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        return cls(
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(tied),
            attention_bias=architecture == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias")),
            qk_norm=architecture == "Qwen3ForCausalLM",
            rope_scaling=_rope_scaling(cfg),
            vision=full if vision else None,
            image_token_id=full.get("image_token_id") if vision else None,
        )


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict[str, Any]) -> RopeScaling | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    if kind not in ("llama3", "linear"):
        raise UnsupportedArchitecture(
            f"rope_scaling type {kind!r} is not supported; supported: llama3, linear"
        )
    return RopeScaling(
        kind=kind,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


_OPTIONS = EngineOptions()  # the flags' defaults, which an engine started from code shares


@dataclass(slots=True)
class EngineArgs:
    """Knobs shared by every entry point.

    ``num_kv_blocks`` and ``kv_cache_bytes`` are alternatives, the block count
    winning when both are set; ``gpu_memory_utilization``, given alone, sizes
    the cache to fill that fraction of a CUDA device (``engine.gpu_memory``).
    With none, the cache holds one sequence of ``max_model_len`` tokens or
    ``max_num_seqs`` sequences of ``KV_TOKENS_PER_SEQUENCE``, whichever is
    more, and never more than ``DEFAULT_KV_CACHE_BYTES``: the sequences share
    it block by block, so a few long ones fit beside many short ones, and when
    they outgrow it the scheduler preempts the newest. Its bytes then follow
    the model's layers, KV heads and dtype, the context length and the batch.
    """

    model: str = "default"  # a registry name or alias, or a local checkpoint path
    registry_file: str | None = None  # TOML registry adding models to the built-in ones
    dtype: str = field(default_factory=default_dtype)  # see engine.precision
    quantization: str = _OPTIONS.quantization  # auto, none, int8 or int4; see engine.precision
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = _OPTIONS.max_num_seqs
    max_num_batched_tokens: int = 2048
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float | None = None  # a fraction of a CUDA device, in (0, 1]
    num_kv_blocks: int | None = None
    block_size: int = 16
    seed: int = 0
    enable_prefix_caching: bool = True
    # False: a CPU text model runs decode steps as a compiled graph (engine.compiled).
    enforce_eager: bool = field(default_factory=default_enforce_eager)
    log_stats: bool = True  # the offline LLM turns it off
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def serving(
        cls, spec: ModelSpec, options: EngineOptions, registry_file: str | None = None
    ) -> EngineArgs:
        """The arguments that load ``spec`` as ``sluice serve`` and ``sluice worker`` serve it:
        by its name in the registry it came from (``registry_file``, else the built-in one;
        a path or a hub id resolves as itself), with the entry's context length as the limit
        unless the options give one."""
        return cls(
            model=spec.name,
            registry_file=registry_file,
            dtype=options.dtype,
            quantization=options.quantization,
            enforce_eager=options.enforce_eager,
            max_model_len=options.max_model_len or spec.context_length or None,
            max_num_seqs=options.max_num_seqs,
            kv_cache_bytes=options.kv_cache_bytes,
            gpu_memory_utilization=options.gpu_memory_utilization,
        )


DEFAULT_KV_CACHE_BYTES = 2 * 1024**3
KV_TOKENS_PER_SEQUENCE = 128
"""What the default KV cache reserves per sequence of the batch: a short chat turn."""
