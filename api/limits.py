"""The admission bound and the deadlines of a served model's requests."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.wire import Deadlines

if TYPE_CHECKING:
    from api.settings import Settings


@dataclass(frozen=True, slots=True)
class Limits:
    """Admission bound and deadlines (seconds), from ``Settings``.

    ``queue_timeout_s`` bounds the wait for a worker to start the job (and,
    at admission, for a live worker to exist); ``first_token_timeout_s`` and
    ``total_timeout_s`` are counted from submission.
    """

    queue_timeout_s: float = 30.0
    first_token_timeout_s: float = 60.0
    total_timeout_s: float = 600.0
    max_inflight: int = 256

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        return cls(
            queue_timeout_s=settings.queue_timeout_s,
            first_token_timeout_s=settings.first_token_timeout_s,
            total_timeout_s=settings.total_timeout_s,
            max_inflight=settings.max_inflight,
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
