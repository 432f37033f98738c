"""What a job is: its record, its status, and the chunks of its event stream.

A record holds everything needed to run the job again from nothing but the
record: the endpoint and body as submitted (another API process re-prepares
them to adopt the job) and the identity of its response (``response_id``,
``response_created``), so every process builds the same chunks and the same
final object. The runner fills in the outcome; ``view`` is what clients see.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from api.errors import bad_request

MAX_METADATA_PAIRS = 16
MAX_METADATA_LENGTH = 512


class JobStatus(StrEnum):
    QUEUED = "queued"  # accepted, no event from the engine yet
    RUNNING = "running"  # the engine reported the prompt scheduled
    COMPLETED = "completed"  # result holds the final response object
    FAILED = "failed"  # error says why; the stream ends with the protocol's error chunks
    CANCELLED = "cancelled"  # DELETE landed before the end
    EXPIRED = "expired"  # retention ended: only this status and the identity are left

    @property
    def terminal(self) -> bool:
        return self not in (JobStatus.QUEUED, JobStatus.RUNNING)


@dataclass(slots=True, frozen=True)
class StoredChunk:
    """One protocol SSE event, serialised exactly as the synchronous stream writes it."""

    data: str
    event: str | None = None


@dataclass(slots=True)
class JobRecord:
    """One job; times are unix seconds."""

    id: str
    endpoint: str  # the protocol path, e.g. "/v1/chat/completions"
    body: dict[str, Any]
    metadata: dict[str, str]
    owner: str | None  # the API key that submitted it; None while there is no authentication
    response_id: str  # the response's own id (chatcmpl-…, resp_…, msg_…) and the engine's
    response_created: int
    created_at: float
    expires_at: float
    status: JobStatus = JobStatus.QUEUED
    started_at: float | None = None
    finished_at: float | None = None
    usage: dict[str, int] | None = None
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    events: bool = True  # whether its stream's chunks are stored (a batch's lines need none)

    def view(self, *, with_result: bool = True) -> dict[str, Any]:
        """The JSON clients get; ``result`` only when completed (and asked for)."""
        return {
            "id": self.id,
            "object": "job",
            "endpoint": self.endpoint,
            "status": self.status.value,
            "created_at": _seconds(self.created_at),
            "started_at": _seconds(self.started_at),
            "finished_at": _seconds(self.finished_at),
            "expires_at": _seconds(self.expires_at),
            "metadata": self.metadata,
            "usage": self.usage,
            "result": self.result if with_result else None,
            "error": self.error,
        }

    def tombstone(self) -> JobRecord:
        """What is left after retention: identity, metadata, and the status ``expired``."""
        return JobRecord(
            id=self.id,
            endpoint=self.endpoint,
            body={},
            metadata=self.metadata,
            owner=self.owner,
            response_id=self.response_id,
            response_created=self.response_created,
            created_at=self.created_at,
            expires_at=self.expires_at,
            status=JobStatus.EXPIRED,
            events=self.events,
        )

    def visible_to(self, owner: str | None) -> bool:
        """Jobs without an owner (no authentication) are everyone's."""
        return self.owner is None or self.owner == owner

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobRecord:
        return cls(**{**data, "status": JobStatus(data["status"])})


@dataclass(slots=True)
class JobOutcome:
    """How a runner ends a job: the terminal status and what it leaves behind."""

    status: JobStatus
    usage: dict[str, int] | None = None
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    finished_at: float = field(default_factory=time.time)


def new_job_hex() -> str:
    """The random part shared by a job's id and its response's id."""
    return secrets.token_hex(12)


def read_metadata(value: Any) -> dict[str, str]:
    """Up to 16 string pairs, like OpenAI's ``metadata``; a 400 naming the field otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"metadata must be an object, got {type(value).__name__}", "metadata")
    if len(value) > MAX_METADATA_PAIRS:
        raise bad_request(
            f"metadata may hold at most {MAX_METADATA_PAIRS} pairs, got {len(value)}", "metadata"
        )
    for key, item in value.items():
        if not isinstance(item, str) or len(key) > 64 or len(item) > MAX_METADATA_LENGTH:
            raise bad_request(
                f"metadata.{key} must be a string of at most {MAX_METADATA_LENGTH} characters "
                f"(keys at most 64), got {item!r}",
                f"metadata.{key}",
            )
    return dict(value)


def _seconds(value: float | None) -> int | None:
    return None if value is None else int(value)


__all__ = [
    "JobOutcome",
    "JobRecord",
    "JobStatus",
    "StoredChunk",
    "new_job_hex",
    "read_metadata",
]
