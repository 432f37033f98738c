"""``sluice`` refuses bad options with a message, not a traceback."""

from __future__ import annotations

import pytest

from api.cli import build_parser, main
from workers.app import broker_transport_options
from workers.main import build_parser as build_worker_parser
from workers.visibility import MIN_REFRESHES_PER_TIMEOUT, REFRESH_INTERVAL_S

UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"  # never contacted: the options fail first


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--model", "nope"], "The supported API model names are default"),
        (["--quantization", "int8", "--dtype", "float32"], "computes in bfloat16"),
    ],
)
def test_generate_refuses_bad_options(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", *options, "hello"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        # 0 is no "unbounded": admission would answer every request with a 429
        ("--max-inflight", "0", "must be at least 1, got 0"),
        ("--max-inflight", "x", "expected a whole number"),
        # a request's stream and lease live an hour from its run's start
        ("--total-timeout", "3600", "must be more than 0 and less than 3600 s, got 3600"),
        ("--total-timeout", "0", "must be more than 0 and less than 3600 s, got 0"),
    ],
)
def test_serve_refuses_limits_it_cannot_keep(
    option: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--redis", UNREACHABLE_REDIS, option, value])
    assert exited.value.code == 2
    assert f"argument {option}: {message}" in capsys.readouterr().err


def test_serve_takes_limits_within_range() -> None:
    args = build_parser().parse_args(["serve", "--max-inflight", "1", "--total-timeout", "3599"])
    assert (args.max_inflight, args.total_timeout) == (1, 3599.0)


def test_worker_refuses_a_visibility_timeout_its_heartbeats_cannot_beat(
    capsys: pytest.CaptureFixture[str],
) -> None:
    minimum_s = MIN_REFRESHES_PER_TIMEOUT * REFRESH_INTERVAL_S
    too_short = str(minimum_s / 2)
    with pytest.raises(SystemExit) as exited:
        main(["worker", "--redis", UNREACHABLE_REDIS, "--visibility-timeout", too_short])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "argument --visibility-timeout" in error and f"at least {minimum_s:g}s" in error


def test_a_killed_worker_s_job_is_back_before_the_api_s_deadlines() -> None:
    """Default timing: redelivery after a ``kill -9`` beats the queue and first-token deadlines.

    A live worker's job, refreshed every heartbeat, is not redelivered unless
    it misses many refreshes in a row.
    """
    serve = build_parser().parse_args(["serve"])
    worker = build_worker_parser().parse_args(["--redis", UNREACHABLE_REDIS])
    sweep_s = broker_transport_options(worker.visibility_timeout)["unacked_restore_interval"]
    redelivered_within_s = REFRESH_INTERVAL_S + worker.visibility_timeout + sweep_s
    assert redelivered_within_s < serve.queue_timeout < serve.first_token_timeout
    assert worker.visibility_timeout >= 5 * MIN_REFRESHES_PER_TIMEOUT * REFRESH_INTERVAL_S
