"""``sluice worker`` argument handling (the running worker is covered by the other tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared import keys
from shared.registry import default_registry
from workers.main import build_parser, main, split_queues, worker_queues


def test_unknown_model_fails_before_loading_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--redis", "redis://127.0.0.1:1/0", "--model", "no-such-model"]) == 2
    assert "no-such-model" in capsys.readouterr().err


def test_extra_queues_may_be_repeated_or_comma_separated() -> None:
    args = build_parser().parse_args(["--redis", "redis://x", "--queues", "a,b", "c"])
    assert split_queues(args.queues) == ["a", "b", "c"]
    assert args.drain_grace == 30 and args.max_num_seqs == 64


def test_another_model_s_queue_is_refused_before_loading_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its jobs would each be answered with an error instead of waiting for their own worker."""
    config = tmp_path / "models.toml"
    config.write_text('[models.other]\nweights = "/nowhere/other.gguf"\n')
    queue = keys.queue_name("other")
    argv = ["--redis", "redis://127.0.0.1:1/0", "--config", str(config), "--queues", f"x,{queue}"]

    assert main(argv) == 2
    assert f"queue {queue!r} holds the jobs of model 'other'" in capsys.readouterr().err


def test_extra_queues_follow_the_model_s_own() -> None:
    spec = default_registry().resolve("default")
    queues = worker_queues(default_registry(), spec, ["batch"])
    assert queues == [keys.queue_name(spec.name), "batch"]


def test_a_queue_name_with_a_control_character_is_refused() -> None:
    """A taken record is ``<wake>\\n<list>\\n<message>``: a newline in a name would split it."""
    spec = default_registry().resolve("default")
    with pytest.raises(ValueError, match="control character"):
        worker_queues(default_registry(), spec, ["bad\nqueue"])


def test_kv_cache_memory_is_a_size() -> None:
    args = build_parser().parse_args(["--redis", "redis://x", "--kv-cache-memory", "1.5GiB"])
    assert args.kv_cache_memory == 3 * 2**29


def test_gpu_memory_utilization_is_a_fraction() -> None:
    args = build_parser().parse_args(["--redis", "redis://x", "--gpu-memory-utilization", "0.9"])
    assert args.gpu_memory_utilization == 0.9
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--redis", "redis://x", "--gpu-memory-utilization", "2"])
