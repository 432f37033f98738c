"""The engine options every command that starts an engine takes, each one flag.

``sluice serve`` (its embedded engine), ``sluice worker``, ``generate`` and
``warmup`` build these flags from ``EngineOptions`` (``shared.flags``), so
each default is written here once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.execution import ENFORCE_EAGER_HELP, default_enforce_eager
from shared.flags import at_least_one, flag
from shared.precision import DTYPE_HELP, QUANTIZATION_CHOICES, QUANTIZATION_HELP, default_dtype
from shared.sizes import byte_size_argument, fraction_argument


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How an engine runs its model: precision, graphs, batch and KV cache size."""

    dtype: str = field(default_factory=default_dtype, metadata=flag(DTYPE_HELP))
    quantization: str = field(
        default="auto", metadata=flag(QUANTIZATION_HELP, choices=QUANTIZATION_CHOICES)
    )
    enforce_eager: bool = field(
        default_factory=default_enforce_eager, metadata=flag(ENFORCE_EAGER_HELP, switch=True)
    )
    max_model_len: int | None = field(
        default=None,
        metadata=flag(
            "the longest prompt plus completion (default: the model's context length)",
            parse=at_least_one,
            metavar="N",
        ),
    )
    max_num_seqs: int = field(
        default=64,
        metadata=flag(
            "sequences in the running batch; a worker takes as many jobs at once",
            parse=at_least_one,
            metavar="N",
        ),
    )
    kv_cache_bytes: int | None = field(
        default=None,
        metadata=flag(
            "the KV cache's size, e.g. 512MiB or 2GiB (default: one --max-model-len sequence "
            "or --max-num-seqs sequences of 128 tokens, whichever is more, at most 2 GiB)",
            names=("--kv-cache-memory", "--kv-cache-memory-bytes"),  # the second is vLLM's
            parse=byte_size_argument,
            metavar="SIZE",
        ),
    )
    gpu_memory_utilization: float | None = field(
        default=None,
        metadata=flag(
            "on a CUDA device, size the KV cache so that the device is this fraction full, "
            "counting the weights, a step's activations and what other processes hold, e.g. "
            "0.9 (default: sized as --kv-cache-memory's default)",
            parse=fraction_argument,
            metavar="FRACTION",
        ),
    )
