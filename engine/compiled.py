"""Decode steps on a CPU as graphs compiled ahead of time by AOTInductor.

A batch-1 decode step of a small model is a few hundred small ops, and in
eager mode each one returns to Python between kernels: the dispatch costs
about as much as the kernels. A graph compiled by inductor runs the whole
forward pass from one C++ function, with the elementwise work between the
matmuls (norms, rotary, residuals, SiLU, casts) fused into a few loops, and
it releases the GIL while it runs. What each graph computes is in
``engine.decode_compiler``.

Two graphs serve every decode batch: one for a single sequence and one for
``2..MAX_ROWS`` sequences; each takes any context and any KV cache size. Prefill
chunks and larger batches run eagerly. A graph computes each row as an eager
step does, bit for bit: the matmuls, norms, SiLU and attention are the
engine's own kernels, which both call, and inductor keeps every bfloat16
rounding an eager op makes (``emulate_precision_casts``) where it would
otherwise carry float32 through a fused loop. So a token decoded through a
graph has the logits it has when a prefill or an eager step computes it, which
the engine's batch invariance (``engine.precision``) rests on. Inductor does
not autotune its matmuls for the same reason: a template of its own would
round differently from the kernel an eager step runs.

Compiling runs in a child process (``engine.decode_compiler``), once per
model, machine and PyTorch version; processes starting together wait for the
one that compiles. A server does not wait: ``warm_up(background=True)`` leaves
the compile to a thread, steps run eagerly meanwhile, and the first step after
it has finished loads the graphs (a second or so) and runs through them from
then on; since a graph computes what an eager step does, the switch changes no
token. What it makes is kept under
``CACHE_DIR/decode/<key>``, where the key hashes everything the generated
code depends on (the weights, this code, the CPU, the thread count, whether
the engine's own kernels run): for each graph a shared library, loaded in
place by PyTorch's C++ runner, the constants compiling made, and where the
graph calls those kernels (``engine.model.vnni_gemm``, ``engine.model.rowwise``,
``engine.attention.paged_decode``) the description of those calls that the
runner reads from beside the library. So this process never imports dynamo or
inductor, keeps nothing compiling leaves behind, and a later start loads the
graphs in about a second. Loading hands each graph the model's own tensors; only the
constants compiling made (a dense layer's repacked weights, say) are read from
the cache, and graphs share identical ones.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine import CACHE_DIR
from engine.attention import BatchLayout, KVCache, paged_decode
from engine.attention.torch_backend import padded_tables
from engine.model import rowwise, vnni_gemm
from shared.heap import return_free_memory

log = logging.getLogger(__name__)

MAX_ROWS = 64
"""The largest decode batch a graph takes; beyond it a step is GEMM-bound."""

MANY_ROWS_EXAMPLE = 3
"""The batch the many-rows graph is exported with."""

MIN_BLOCKS = 2
"""Block tables are padded to at least this width, so that export never specializes it."""

COMPILE_TIMEOUT_S = 3600

COMPILE_PARENT_ENV = "SLUICE_COMPILE_PARENT"
"""The pid of the process that starts a compile, which the compiling child ends with."""

STALE_AFTER_S = 30 * 24 * 3600
"""Compiled graphs no start has loaded for this long are deleted when a start compiles: an
upgrade of this code or of PyTorch changes the key, and the old entry would stay for good."""

_SOURCES = (
    "model",
    "attention/torch_backend.py",
    "attention/paged_decode.py",
    "decode_compiler.py",
    "compiled.py",
)
"""The engine code a graph is traced from, relative to the package: part of the cache key."""


class Graph(NamedTuple):
    """A decode graph: the rows it is exported with, and the rows it takes."""

    rows: int
    least: int
    most: int


def context(
    block_tables: list[list[int]], context_lens: list[int], block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode batch's block tables ``[rows, blocks]`` of the slots before each new token, and
    the additive mask ``[rows, 1, 1, blocks * block_size + 1]`` over them and the new one."""
    before = [length - 1 for length in context_lens]
    tables, mask = padded_tables(block_tables, before, block_size, MIN_BLOCKS)
    mask = F.pad(mask, (0, 1))  # the new token's own column: always seen
    return tables, mask[:, None, None, :]


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by the name a graph's constants carry (tied ones twice)."""
    named = [*model.named_parameters(remove_duplicate=False)]
    named += model.named_buffers(remove_duplicate=False)
    return {f"model.{name}": tensor.detach() for name, tensor in named}


class CompiledDecode:
    """``model``'s forward pass over decode batches of up to ``MAX_ROWS`` sequences."""

    def __init__(self, model: nn.Module, kv_cache: KVCache, max_num_seqs: int):
        """``max_num_seqs``: the engine's batch limit; graphs for larger batches are not built."""
        self.model = model
        self.kv_cache = kv_cache
        self.max_rows = min(MAX_ROWS, max_num_seqs)
        self.steps = 0  # decode steps it ran
        self.graphs = {"one": Graph(1, 1, 1)}
        if self.max_rows >= 2:
            self.graphs["many"] = Graph(min(MANY_ROWS_EXAMPLE, self.max_rows), 2, MAX_ROWS)
        # the runner for each batch size, index = rows (0 has none); filled when loaded
        self._by_rows: list[torch._C._aoti.AOTIModelContainerRunnerCpu | None] = []
        self._entry_path: Path | None = None  # where the graphs are kept: see _entry
        self._built: Path | None = None  # compiled in the background, not loaded yet
        self._building: threading.Thread | None = None
        self._build_started = 0.0

    @property
    def loaded(self) -> bool:
        return bool(self._by_rows)

    def takes(self, layout: BatchLayout) -> bool:
        """Whether this step is a decode batch the graphs serve (loading them first, once a
        background compile has finished)."""
        if not self._by_rows:
            if self._built is None:
                return False
            self._switch()
        rows = len(layout.query_lens)
        return rows <= self.max_rows and layout.num_decodes == rows

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout
    ) -> torch.Tensor:
        """Float32 logits of every row; the step's keys and values land in the cache."""
        self.steps += 1
        cache = self.kv_cache
        tables, mask = context(layout.block_tables, layout.context_lens, cache.block_size)
        runner = self._by_rows[len(input_ids)]
        assert runner is not None, "warm_up loads the graphs first"
        logits, keys, values = runner.run([input_ids, positions, tables, mask, cache.k, cache.v])
        cache.k.index_copy_(1, layout.slot_mapping, keys)
        cache.v.index_copy_(1, layout.slot_mapping, values)
        return logits

    def warm_up(self, background: bool = False) -> None:
        """Load the graphs, compiling them first if no start has.

        With ``background`` a compile runs on a thread while steps run
        eagerly, and the first step after it loads the graphs.
        """
        compiled = self._cached_dir()
        if compiled is None and background:
            log.info("compiling the decode graphs in the background; steps run eagerly until then")
            self._build_started = time.perf_counter()
            self._building = threading.Thread(
                target=self._build, name="sluice-compile", daemon=True
            )
            self._building.start()
            return
        self._load_graphs(compiled or self._compiled_dir())

    def wait_built(self, timeout: float | None = None) -> bool:
        """Wait for a background compile; whether the graphs are built (or loaded)."""
        if self._building is not None:
            self._building.join(timeout)
        return self.loaded or self._built is not None

    def _build(self) -> None:
        try:
            self._built = self._compiled_dir()
        except Exception:
            log.warning("decode steps stay eager: compiling them failed", exc_info=True)

    def _switch(self) -> None:
        assert self._built is not None
        self._load_graphs(self._built)
        log.info(
            "decode steps compiled: the graphs took %.0f s to build in the background",
            time.perf_counter() - self._build_started,
        )

    def _load_graphs(self, compiled: Path) -> None:
        """Load the graphs in ``compiled`` and run each once (its first run initializes it);
        the runs write nothing to the KV cache, so a server may load them mid-stream."""
        start = time.perf_counter()
        own = model_tensors(self.model)
        shared: dict[str, torch.Tensor] = {}
        torch.cpu._init_amx()  # lets this process run AMX tiles, where the CPU has them
        by_rows: list[torch._C._aoti.AOTIModelContainerRunnerCpu | None] = [None] * (
            self.max_rows + 1
        )
        cache = self.kv_cache
        for name, graph in self.graphs.items():
            runner = _load(*graph_files(compiled, name), own, shared)
            for rows in range(graph.least, min(graph.most, self.max_rows) + 1):
                by_rows[rows] = runner
            ids = torch.zeros(graph.least, dtype=torch.long)
            tables, mask = context([[0]] * graph.least, [1] * graph.least, cache.block_size)
            runner.run([ids, ids, tables, mask, cache.k, cache.v])  # outputs dropped
        self._by_rows, self._built = by_rows, None
        gc.collect()
        return_free_memory()
        held = sum(t.nbytes for t in shared.values()) / 2**20
        log.info(
            "loaded the decode graphs in %.1f s (%.0f MiB of their own constants)",
            time.perf_counter() - start,
            held,
        )

    def _entry(self) -> Path:
        """The directory this model's graphs are kept in (its key hashes the weights: once)."""
        if self._entry_path is None:
            self._entry_path = Path(CACHE_DIR) / "decode" / self._key()
        return self._entry_path

    def _cached_dir(self) -> Path | None:
        """The directory of this model's compiled graphs, if a start has compiled them."""
        compiled = self._entry()
        if not compiled.is_dir():
            return None
        with contextlib.suppress(OSError):  # a read-only cache is still a cache
            os.utime(compiled)  # in use: not stale
        return compiled

    def _compiled_dir(self) -> Path:
        """The directory of this model's compiled graphs, compiled now if it does not exist."""
        cached = self._cached_dir()
        if cached is not None:
            return cached
        compiled = self._entry()
        root = compiled.parent
        root.mkdir(parents=True, exist_ok=True)
        with _compiling_alone(root / f"{compiled.name}.lock"):
            if compiled.is_dir():  # a process starting beside this one compiled them meanwhile
                return compiled
            _prune(root)
            log.info("compiling the decode graphs in a child process; later starts load them")
            staging = Path(tempfile.mkdtemp(dir=root, prefix=f"{compiled.name}."))
            try:
                self._compile(staging)
                staging.rename(compiled)
            except OSError:
                if not compiled.is_dir():
                    raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)  # gone if renamed
        return compiled

    def _compile(self, out: Path) -> None:
        model_file, spec_file = out / "model.pt", out / "spec.json"
        torch.save(self.model, model_file)
        spec = {
            "threads": torch.get_num_threads(),
            "block_size": self.kv_cache.block_size,
            "kv_dtype": str(self.kv_cache.k.dtype).removeprefix("torch."),
            "graphs": {name: graph._asdict() for name, graph in self.graphs.items()},
        }
        spec_file.write_text(json.dumps(spec))
        command = [sys.executable, "-m", "engine.decode_compiler", str(model_file)]
        # The child imports this very engine, installed or not.
        project = str(Path(__file__).resolve().parent.parent)
        path = os.pathsep.join(filter(None, (project, os.environ.get("PYTHONPATH"))))
        done = subprocess.run(
            [*command, str(spec_file), str(out)],
            env=os.environ | {"PYTHONPATH": path, COMPILE_PARENT_ENV: str(os.getpid())},
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        model_file.unlink()
        if done.returncode != 0:
            raise RuntimeError(f"compiling the decode graphs failed:\n{done.stderr[-4000:]}")

    def _key(self) -> str:
        """A hash of what the generated code depends on."""
        digest = hashlib.blake2b(digest_size=16)
        machine = (
            torch.__version__,
            torch.backends.cpu.get_cpu_capability(),
            torch.cpu._is_amx_tile_supported(),
            torch.cpu._is_avx512_bf16_supported(),
            vnni_gemm.available(),
            paged_decode.available(),
            rowwise.available(),
            torch.get_num_threads(),
            self.kv_cache.block_size,
            self.kv_cache.k.dtype,
            sorted(self.graphs.items()),
        )
        digest.update(repr(machine).encode())
        here = Path(__file__).parent
        for source in (here / name for name in _SOURCES):
            for path in sorted(source.rglob("*.py")) if source.is_dir() else [source]:
                digest.update(path.read_bytes())
        for name, tensor in sorted(model_tensors(self.model).items()):
            digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
            digest.update(_bytes(tensor))
        return digest.hexdigest()


@contextlib.contextmanager
def _compiling_alone(lock: Path) -> Iterator[None]:
    """Hold ``lock`` while compiling, so that processes starting together on one machine (a
    host's workers) compile once: the others wait, rather than compile beside it on the same
    cores for minutes. The lock goes with the process holding it, killed or not."""
    with lock.open("a") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        yield


def _prune(root: Path) -> None:
    """Delete the entries under ``root`` that no start has loaded for ``STALE_AFTER_S``, and
    staging directories and locks that old (a compile that was killed)."""
    cutoff = time.time() - STALE_AFTER_S
    for entry in root.iterdir():
        if entry.suffix == ".lock" and entry.stat().st_mtime < cutoff:
            entry.unlink(missing_ok=True)
        elif entry.is_dir() and entry.stat().st_mtime < cutoff:
            log.info("deleting compiled decode graphs no start has loaded since %s", entry.name)
            shutil.rmtree(entry, ignore_errors=True)


def graph_files(directory: Path, name: str) -> tuple[Path, Path]:
    """A compiled graph's shared library, and the constants compiling made for it by name."""
    return directory / f"{name}.so", directory / f"{name}.constants"


def _load(
    library: Path, made_file: Path, own: dict[str, torch.Tensor], shared: dict[str, torch.Tensor]
) -> torch._C._aoti.AOTIModelContainerRunnerCpu:
    """Load a graph with the model's own tensors and the constants compiling made, one copy
    of each for every graph that holds the same (``shared``, by content hash)."""
    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(library), 1)
    made = torch.load(made_file, weights_only=True)
    constants = {}
    for name, fqn in runner.get_constant_names_to_original_fqns().items():
        if fqn in own:
            constants[name] = own[fqn]
        else:
            constants[name] = shared.setdefault(_identity(made[fqn]), made[fqn])
    runner.update_constant_buffer(constants, False, True, True)  # user-managed: not copied
    return runner


def _identity(tensor: torch.Tensor) -> str:
    """Equal for tensors of equal layout and content."""
    content = hashlib.blake2b(_bytes(tensor)).hexdigest()
    return f"{tensor.dtype} {tuple(tensor.shape)} {tensor.stride()} {content}"


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
