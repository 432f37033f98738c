"""Builds what an engine runs on: tokenizer, model, KV cache and attention.

Kept apart from the step loop so that tests and benchmarks can build a model
once and hand it to several engines.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.attention import AttentionBackend, KVCache, make_backend, paged_decode
from engine.config import DEFAULT_KV_CACHE_BYTES, KV_TOKENS_PER_SEQUENCE, EngineArgs, ModelConfig
from engine.gpu_memory import activation_peak, check_utilization, kv_cache_bytes
from engine.loader import Checkpoint, load_checkpoint
from engine.model.idefics3 import Idefics3ForConditionalGeneration
from engine.model.layers import Linear
from engine.model.llama import LlamaForCausalLM
from engine.model.quantized import quantize_linears
from engine.precision import Precision, precision_for, stored_methods
from shared.heap import return_free_memory
from shared.images.layout import ImageProcessing
from shared.images.loading import image_processing_for
from shared.registry import ModelRegistry, default_registry
from shared.tokenizer_loader import LoadedTokenizer, load_tokenizer


@dataclass(slots=True)
class LoadedModel:
    tokenizer: LoadedTokenizer
    model: LlamaForCausalLM | Idefics3ForConditionalGeneration
    attention: AttentionBackend
    device: torch.device
    precision: Precision
    max_model_len: int
    num_blocks: int
    image_processing: ImageProcessing | None = None  # a vision model's; None for text
    quantized: dict[str, str] = field(default_factory=dict)  # the method of each quantized layer

    @property
    def dtype(self) -> torch.dtype:
        return self.precision.dtype


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_engine_model(args: EngineArgs) -> LoadedModel:
    """Load on one CPU thread, so that only the thread that steps the model runs parallel ops.

    OpenMP keeps a team of worker threads for each thread that runs a parallel
    region. A server loads on one thread and steps on another, and with the
    loading thread's team left behind, every step ran at half speed (single
    stream, 2 cores). A serial load creates no team.
    """
    with _one_cpu_thread():
        return _load(args)


@contextmanager
def _one_cpu_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _load(args: EngineArgs) -> LoadedModel:
    registry = (
        ModelRegistry.from_toml(args.registry_file) if args.registry_file else default_registry()
    )
    spec = registry.resolve(args.model, hub=True)
    device = resolve_device(args.device)
    check_utilization(args, device)
    precision = precision_for(args.dtype, args.quantization, device)
    dtype = precision.dtype
    checkpoint = load_checkpoint(Path(spec.weights), dtype)
    cfg = ModelConfig.from_hf(checkpoint.config)
    heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    if precision.batch_invariant and not paged_decode.serves_heads(*heads):
        precision = replace(precision, batch_invariant=False)  # its prefill attends by SDPA
    max_model_len = _max_model_len(args, cfg, spec.context_length)
    architecture = LlamaForCausalLM if cfg.vision is None else Idefics3ForConditionalGeneration
    with torch.device(device):
        model = architecture(cfg, max_model_len).to(dtype)
    text_model = getattr(model, "text", model)  # a vision encoder stays dense
    methods = _methods(precision, text_model, checkpoint.stored_bits)
    quantized: dict[str, str] = {}
    tensors = checkpoint.tensors
    if text_model is model:
        tensors = _quantizing(checkpoint, model, methods, quantized)
    model.load_weights(tensors)
    # What loading left: a vision model's text layers, layers the header does not name.
    rest = {layer: method for layer, method in methods.items() if layer not in quantized}
    quantized |= quantize_linears(text_model, rest)
    model.eval()
    kv_dtype = precision.kv_dtype
    num_blocks = _num_blocks(args, cfg, kv_dtype, max_model_len, model, device)
    kv_cache = KVCache.allocate(
        cfg.num_layers,
        num_blocks,
        args.block_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        kv_dtype,
        device,
    )
    # A tokenizer in the weights' own GGUF is read through the reader the weights used.
    same_file = Path(spec.tokenizer) == Path(spec.weights)
    tokenizer = load_tokenizer(spec.tokenizer, checkpoint.gguf if same_file else None)
    del checkpoint  # and the file mapping its tensors were read from
    return_free_memory()
    return LoadedModel(
        tokenizer=tokenizer,
        model=model,
        attention=make_backend(kv_cache, device),
        device=device,
        precision=precision,
        max_model_len=min(max_model_len, num_blocks * args.block_size),
        num_blocks=num_blocks,
        image_processing=image_processing_for(spec),
        quantized=quantized,
    )


def layer_bits(model: LlamaForCausalLM, stored_bits: dict[str, float | None]) -> dict[str, list]:
    """The stored widths of the checkpoint tensors fused into each layer, by layer name."""
    layers: dict[str, list[float | None]] = defaultdict(list)
    for hf_name, bits in stored_bits.items():
        for layer in tensor_layers(model, hf_name):
            layers[layer].append(bits)
    return layers


def _methods(
    precision: Precision, model: LlamaForCausalLM, stored_bits: dict[str, float | None]
) -> dict[str, str]:
    """The quantization of each linear layer that gets one."""
    if precision.quantization == "stored":
        return stored_methods(layer_bits(model, stored_bits))
    if precision.quantization == "none":
        return {}
    linears = (name for name, module in model.named_modules() if isinstance(module, Linear))
    return dict.fromkeys(linears, precision.quantization)


def tensor_layers(model: LlamaForCausalLM, hf_name: str) -> list[str]:
    """The layers a checkpoint tensor fills: its own, and the head a tied embedding is."""
    layer = model.target(hf_name.removeprefix("model."))[0].rpartition(".")[0]
    tied = layer == "embed_tokens" and model.cfg.tie_word_embeddings
    return [layer, "lm_head"] if tied else [layer]


def _quantizing(
    checkpoint: Checkpoint,
    model: LlamaForCausalLM,
    methods: dict[str, str],
    quantized: dict[str, str],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors; each layer of ``methods`` is quantized once its last is in.

    Layers are counted from the names in ``stored_bits`` (a GGUF's header);
    an HF checkpoint names none, so its layers are all quantized after loading.

    A tensor is copied in between two steps of this generator, so when the
    next is asked for, the layers it completed are quantized (and their dense
    weights freed): the dense model never exists whole, and loading peaks near
    one dense layer above the quantized model. ``quantized`` gets each
    layer's method.
    """
    remaining = Counter(
        layer for hf_name in checkpoint.stored_bits for layer in tensor_layers(model, hf_name)
    )
    for hf_name, tensor in checkpoint.tensors:
        yield hf_name, tensor
        for layer in tensor_layers(model, hf_name):
            remaining[layer] -= 1
            if remaining[layer] == 0 and layer in methods:
                quantized |= quantize_linears(model, {layer: methods[layer]})


def _max_model_len(args: EngineArgs, cfg: ModelConfig, context_length: int) -> int:
    limit = min(cfg.max_position_embeddings, context_length or cfg.max_position_embeddings)
    if args.max_model_len is None:
        return limit
    if args.max_model_len > cfg.max_position_embeddings:
        raise ValueError(
            f"max_model_len {args.max_model_len} exceeds the model's "
            f"max_position_embeddings {cfg.max_position_embeddings}"
        )
    return args.max_model_len


def _num_blocks(
    args: EngineArgs,
    cfg: ModelConfig,
    dtype: torch.dtype,
    max_model_len: int,
    model: torch.nn.Module,
    device: torch.device,
) -> int:
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    per_block = KVCache.bytes_per_block(
        cfg.num_layers, args.block_size, cfg.num_kv_heads, cfg.head_dim, dtype
    )
    if args.kv_cache_bytes is not None:
        return max(1, args.kv_cache_bytes // per_block)
    if args.gpu_memory_utilization is not None:
        peak = activation_peak(model, cfg, args, dtype, device, max_model_len)
        return max(1, kv_cache_bytes(args.gpu_memory_utilization, peak, device) // per_block)
    tokens = max(max_model_len, args.max_num_seqs * KV_TOKENS_PER_SEQUENCE)
    wanted = -(-min(tokens, args.max_num_seqs * max_model_len) // args.block_size)
    return max(1, min(wanted, DEFAULT_KV_CACHE_BYTES // per_block))
