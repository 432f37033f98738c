"""What the API hands to a backend: one prepared request, protocol-free.

A ``PreparedRequest`` is everything an engine needs to run a request and
everything the API needs to read its output back, and nothing a protocol
owns. It crosses the process boundary in distributed mode, so it is a plain
dataclass of JSON-friendly values (``to_dict``/``from_dict``) with no torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from shared.prefix_hash import ImageSpan
from shared.sampling import SamplingParams


@dataclass(slots=True)
class ParsingOptions:
    """How to read the generated text: which markup is reasoning or a tool call.

    Delimiter pairs are ``(open, close)``; ``None`` turns the feature off so its
    markup stays plain content. ``starts_in_reasoning`` is set when the prompt
    itself opened the reasoning block; ``bare_json_tool_calls`` reads Llama 3's
    undelimited JSON calls at the start of the answer; ``dsml_tool_calls`` reads the
    ``tool_calls`` block as DeepSeek's DSML invokes, and ``starts_in_tool_calls`` when the
    prompt opened that block (a forced call); ``single_tool_call`` when the client
    allowed one tool call per turn (the answer ends after it).
    """

    reasoning: tuple[str, str] | None = None
    starts_in_reasoning: bool = False
    tool_calls: tuple[str, str] | None = None
    bare_json_tool_calls: bool = False
    dsml_tool_calls: bool = False
    starts_in_tool_calls: bool = False
    single_tool_call: bool = False


@dataclass(frozen=True, slots=True)
class WireImage:
    """An image of the prompt: its encoded bytes (base64), its pixels' digest (hex), and the
    prompt positions ``[start, end)`` its tokens fill.

    The encoded bytes cross, not the preprocessed tensor: a 1024x1024 JPEG is
    a few hundred kB where its tiles, preprocessed, are tens of MB; the
    engine's host decodes and preprocesses it again.
    """

    data: str
    digest: str
    start: int
    end: int

    @property
    def span(self) -> ImageSpan:
        return ImageSpan(self.start, self.end, bytes.fromhex(self.digest))


@dataclass(slots=True)
class PreparedRequest:
    """One request, ready to run: token ids, sampling and parsing options.

    ``request_id`` is unique per request and is the id the engine and every
    event use; ``model`` is the registry name (not an alias); ``created`` is
    unix seconds at arrival, for queue deadlines and latency metrics.
    """

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    parsing: ParsingOptions = field(default_factory=ParsingOptions)
    priority: int = 0
    created: float = 0.0
    images: list[WireImage] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready and shallow: the dict shares this request's lists.

        ``dataclasses.asdict`` deep-copies every list element, which for a long
        prompt costs milliseconds on the API's event loop.
        """
        data = {
            "request_id": self.request_id,
            "model": self.model,
            "prompt_token_ids": self.prompt_token_ids,
            "sampling": _sampling_dict(self.sampling),
            "parsing": _shallow(self.parsing),
            "priority": self.priority,
            "created": self.created,
        }
        if self.images:  # absent otherwise: an earlier worker reads the rest unchanged
            data["images"] = [_shallow(image) for image in self.images]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PreparedRequest:
        parsing = dict(data.get("parsing") or {})
        for key in ("reasoning", "tool_calls"):
            if parsing.get(key) is not None:
                parsing[key] = tuple(parsing[key])
        return cls(
            request_id=data["request_id"],
            model=data["model"],
            prompt_token_ids=list(data["prompt_token_ids"]),
            sampling=SamplingParams(**data["sampling"]),
            parsing=ParsingOptions(**parsing),
            priority=int(data.get("priority", 0)),
            created=float(data.get("created", 0.0)),
            images=[WireImage(**image) for image in data.get("images", ())],
        )


JOB_VERSION = 1


@dataclass(slots=True)
class Deadlines:
    """Absolute unix times after which a request is failed rather than served.

    ``queue``: the job must have started (its first event written) by then;
    it is also the Celery ``expires``. ``first_token`` and ``total`` bound time
    to first token and the whole generation. ``None`` means no limit.
    """

    queue: float | None = None
    first_token: float | None = None
    total: float | None = None

    def pending(self, started: bool, first_token: bool) -> tuple[float | None, str]:
        """The earliest deadline a request that got this far must still meet (None: none),
        and the error kind when it passes: ``queue_timeout`` until it starts,
        ``first_token_timeout`` until its first token, ``total_timeout`` always."""
        candidates = [(self.total, "total_timeout")]
        if not first_token:
            candidates.append((self.first_token, "first_token_timeout"))
        if not started:
            candidates.append((self.queue, "queue_timeout"))
        dated = [(deadline, kind) for deadline, kind in candidates if deadline is not None]
        return min(dated) if dated else (None, "total_timeout")


@dataclass(slots=True)
class QueuedRequest:
    """A prepared request as it travels on the queue, with its deadlines.

    Workers call each one a job: Celery's task runs it (``workers.task``).
    ``origin``: the API process whose client waits for the events
    (``keys.api_process``); a worker stops the job once that process is gone.
    None for one nobody waits on in person (an async job's, which another API
    process adopts when its own dies).
    """

    request: PreparedRequest
    deadlines: Deadlines = field(default_factory=Deadlines)
    origin: str | None = None


def encode_queued(job: QueuedRequest) -> str:
    """Compact JSON with a version field, so workers can refuse what they don't understand."""
    payload = {
        "v": JOB_VERSION,
        "request": job.request.to_dict(),
        "deadlines": _shallow(job.deadlines),
    }
    if job.origin is not None:  # absent otherwise: an earlier worker reads the rest unchanged
        payload["origin"] = job.origin
    return json.dumps(payload, separators=(",", ":"))


def _sampling_dict(sampling: SamplingParams) -> dict[str, Any]:
    data = _shallow(sampling)
    if sampling.structured_outputs is not None:
        data["structured_outputs"] = sampling.structured_outputs.to_dict()
    return data


def _shallow(value: Any) -> dict[str, Any]:
    """A flat dataclass's fields by name, values as they are (no copies)."""
    return {spec.name: getattr(value, spec.name) for spec in fields(value)}


def queued_request_id(payload: str | bytes) -> str | None:
    """The request id of a job that may not decode, so its client can still be told why."""
    try:
        request_id = json.loads(payload)["request"]["request_id"]
    except (ValueError, KeyError, TypeError):
        return None
    return request_id if isinstance(request_id, str) and request_id else None


def decode_queued(payload: str | bytes) -> QueuedRequest:
    data = json.loads(payload)
    if data.get("v") != JOB_VERSION:
        raise ValueError(f"job encoding version {data.get('v')!r} is not {JOB_VERSION}")
    origin = data.get("origin")
    if origin is not None and not isinstance(origin, str):
        raise TypeError(f"job origin {origin!r} is not a string")
    request = PreparedRequest.from_dict(data["request"])
    return QueuedRequest(request, Deadlines(**data["deadlines"]), origin)


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One worker's load, as its heartbeat writes it every second or so (``to_json``) and
    the API's fleet watcher reads it (``from_json``) for placement, admission and metrics."""

    worker_id: str
    model: str
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    tokens_per_s: float = 0.0
    capacity: int = 0
    max_model_len: int = 0
    steps: int = 0
    generated_tokens: int = 0
    aborted: int = 0
    preemptions: int = 0
    draining: bool = False
    block_size: int = 0  # of its KV cache: the blocks its cache summary names
    intake_open: bool = True  # False while its engine waits for KV blocks
    cache_summary_size: int = 0  # block hashes in its cache summary
    ts: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, data: dict) -> WorkerLoad:
        """From the decoded JSON; fields this release does not know are left out, missing
        ones take their defaults (a worker of another release)."""
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        return cls(**known)
