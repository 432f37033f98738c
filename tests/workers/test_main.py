"""``sluice worker`` argument handling (the running worker is covered by the other tests)."""

from __future__ import annotations

import pytest

from workers.main import build_parser, main, split_queues


def test_unknown_model_fails_before_loading_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--redis", "redis://127.0.0.1:1/0", "--model", "no-such-model"]) == 2
    assert "no-such-model" in capsys.readouterr().err


def test_extra_queues_may_be_repeated_or_comma_separated() -> None:
    args = build_parser().parse_args(["--redis", "redis://x", "--queues", "a,b", "c"])
    assert split_queues(args.queues) == ["a", "b", "c"]
    assert args.drain_grace == 30 and args.max_num_seqs == 64
