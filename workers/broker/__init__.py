"""Everything Sluice changes in Celery and kombu, in one place.

Celery stays the worker runtime (its consumer, thread pool and task
protocol); this package holds what a serving queue needs beyond stock
kombu and Celery, each for a reason its module states:

- ``transport``: kombu's Redis transport, waking on tokens and taking,
  recording and starting jobs in one atomic step, per worker, so a dead
  worker's jobs can be handed back in seconds (``scripts/*.lua``);
- ``taken``: the starts the take script made, for the tasks to pick up;
- ``intake``: no jobs taken while the engine waits for KV blocks;
- ``app``: the Celery app and its configuration;
- ``ResumableRequest`` (``app``): a request Celery never expires.

The transport subclasses private parts of kombu's (and ``app`` of Celery's)
code, so the versions are pinned and checked here, at import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared import keys
from shared.versions import require
from workers.broker.intake import Intake
from workers.broker.taken import TakenStarts

require("celery", "kombu")


@dataclass(slots=True)
class BrokerLink:
    """What the transport shares with the rest of one worker."""

    worker_id: str
    own_queue: str = ""  # taken from before any other queue (``keys.own_queue``); "": none
    intake: Intake = field(default_factory=Intake)  # the engine's: closed while KV-bound
    starts: TakenStarts = field(default_factory=TakenStarts)  # the take script's, for tasks

    @property
    def taken_key(self) -> str:
        return keys.taken(self.worker_id)
