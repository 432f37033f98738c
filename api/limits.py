"""The admission bound and the deadlines of a served model's requests."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from shared.flags import at_least_one, flag
from shared.keys import FINISHED_STREAM_TTL_S
from shared.wire import Deadlines


def generation_time(text: str) -> float:
    """``--total-timeout``: seconds, less than a request stream's lifetime.

    Workers give a request's stream and lease an hour to live when its run
    starts and renew it only every few dozen events: a run allowed longer
    could lose them while waiting without events.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < FINISHED_STREAM_TTL_S:
        raise argparse.ArgumentTypeError(
            f"must be more than 0 and less than {FINISHED_STREAM_TTL_S} s, got {value:g}"
        )
    return value


@dataclass(frozen=True, slots=True)
class Limits:
    """Admission bound and deadlines (seconds): flags of ``sluice serve`` (``Settings.limits``).

    ``queue_timeout_s`` bounds the wait for a worker to start the job (and,
    at admission, for a live worker to exist); ``first_token_timeout_s`` and
    ``total_timeout_s`` are counted from submission.
    """

    queue_timeout_s: float = field(
        default=30.0,
        metadata=flag(
            "503 if no worker (or the embedded engine) starts a request within S seconds",
            names=("--queue-timeout",),
            parse=float,
            metavar="S",
        ),
    )
    first_token_timeout_s: float = field(
        default=60.0,
        metadata=flag(
            "504 without a first token after S seconds",
            names=("--first-token-timeout",),
            parse=float,
            metavar="S",
        ),
    )
    total_timeout_s: float = field(
        default=600.0,
        metadata=flag(
            "504 if a generation runs longer than S seconds",
            names=("--total-timeout",),
            parse=generation_time,
            metavar="S",
        ),
    )
    max_inflight: int = field(
        default=256,
        metadata=flag(
            "429 beyond N queued + running requests per model",
            parse=at_least_one,
            metavar="N",
        ),
    )

    def deadlines(self, start: float) -> Deadlines:
        return Deadlines(
            queue=start + self.queue_timeout_s,
            first_token=start + self.first_token_timeout_s,
            total=start + self.total_timeout_s,
        )

    def job_deadlines(self, submitted: float) -> Deadlines:
        """An async job's: a worker must start it, and end it, this long after submission."""
        return Deadlines(
            queue=submitted + self.queue_timeout_s, total=submitted + self.total_timeout_s
        )

    def adoption_deadlines(self, submitted: float) -> Deadlines:
        """An adopted job's: no queue deadline (its events may be there already), and the
        total one, but at least a queue timeout from now to show the events there are."""
        total = max(submitted + self.total_timeout_s, time.time() + self.queue_timeout_s)
        return Deadlines(total=total)
