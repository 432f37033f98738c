"""Redis names shared by the API and the workers: one place, so they agree.

Every key is prefixed ``sluice:``. Per-request keys expire on their own, so a
crashed process never leaves garbage behind for long.
"""

from __future__ import annotations

PREFIX = "sluice"

TASK_NAME = "sluice.generate"  # the Celery task; argument: the encoded PreparedRequest
CANCEL_CHANNEL = f"{PREFIX}:cancel"  # pub/sub: request ids to stop now
EVENT_STREAM_MAXLEN = 10_000  # approximate cap per request stream (XADD MAXLEN ~)
FINISHED_STREAM_TTL_S = 3600  # a finished request's events stay readable this long
HEARTBEAT_INTERVAL_S = 0.5  # how often a worker renews its registry entry and load report
HEARTBEAT_TTL_S = 2.0  # a worker whose entry is this old is dead: its jobs go to the others
API_PROCESS_TTL_S = 10  # an API process that renewed its key this long ago is gone


def event_stream_maxlen(max_model_len: int) -> int:
    """A cap that never trims a stream its worker's engine can fill.

    A request writes at most one entry per generated token (fewer than
    ``max_model_len``) besides its ``Ready`` and its end (the margin);
    trimming the start of a stream would leave a redelivered job nothing to
    resume from.
    """
    return max(EVENT_STREAM_MAXLEN, max_model_len + 64)


def queue_name(model: str) -> str:
    """The Celery queue of one model: workers serving it consume only this."""
    return f"{PREFIX}.{model}"


OWN_QUEUE_MARK = "@"  # between a model's queue name and a worker id: that worker's own queue


def own_queue(model: str, worker_id: str) -> str:
    """The queue of one worker of ``model``: the jobs placed there for its cached prefix.

    The worker takes from it before the model's shared queue; what waits in
    it past its hand-back time, or when the worker drains, leaves or dies,
    goes to the head of the shared queue (``workers/broker/scripts``).
    """
    return f"{queue_name(model)}{OWN_QUEUE_MARK}{worker_id}"


def queue_wake(queue: str) -> str:
    """A list holding one token per job put on ``queue``'s lists: what workers block on.

    A worker pops a token, never a job: the jobs leave their lists only in
    the script that records them as taken (``workers.broker.transport``), so a
    worker killed between waking and taking loses a token, not a request.
    """
    return f"{PREFIX}:wake:{queue}"


def reader_interrupt(reader_id: str) -> str:
    """A stream an API process's event reader also reads: an entry returns its blocked read."""
    return f"{PREFIX}:interrupt:{reader_id}"


def event_stream(request_id: str) -> str:
    """Redis Stream of one request's events, in order, across attempts."""
    return f"{PREFIX}:events:{request_id}"


def lease(request_id: str) -> str:
    """The current attempt number of a request; a writer whose attempt differs is stale."""
    return f"{PREFIX}:lease:{request_id}"


def cancel_flag(request_id: str) -> str:
    """Set when the client is gone; a job that starts with it set is dropped unrun."""
    return f"{PREFIX}:cancelled:{request_id}"


def workers(model: str) -> str:
    """The registry of a model's workers: a sorted set of worker ids, scored by expiry.

    Each heartbeat pushes its worker's expiry ``HEARTBEAT_TTL_S`` past Redis's
    clock; an entry whose expiry has passed belongs to a dead worker, whose
    jobs the next live worker's heartbeat hands back (``workers.heartbeat``).
    """
    return f"{PREFIX}:workers:{model}"


def workers_alive_since(model: str) -> str:
    """Beside ``workers``: when each entry last went from expired (or missing) to renewed."""
    return f"{PREFIX}:workers-since:{model}"


def worker_loads(model: str) -> str:
    """A hash of the model's workers' load reports (JSON), by worker id, beside ``workers``."""
    return f"{PREFIX}:loads:{model}"


CACHE_SUMMARY_PREFIX = f"{PREFIX}:cache:"


def cache_summary(worker_id: str) -> str:
    """A set of the prefix block hashes a worker's cache holds (16-byte digests).

    Written by the worker as its cache changes, renewed by its heartbeat and
    deleted when it leaves or is found dead; the API reads it to place
    requests where their prefix is cached (``api.backends.placement``).
    """
    return f"{CACHE_SUMMARY_PREFIX}{worker_id}"


TAKEN_PREFIX = f"{PREFIX}:taken:"


def taken(worker_id: str) -> str:
    """A hash of the messages a worker took and has not acked: delivery tag -> record.

    The record is ``<wake list>\n<queue list>\n<message>``: what it takes
    to put the message back where it was (``workers/broker/scripts``).
    """
    return f"{TAKEN_PREFIX}{worker_id}"


def api_process(process_id: str) -> str:
    """Present while the API process ``process_id`` lives: its clients wait for their events.

    Renewed every second with a TTL of ``API_PROCESS_TTL_S``; a worker cancels
    the jobs of a process whose key is gone, since nobody will read them.
    """
    return f"{PREFIX}:api:{process_id}"


def inflight(model: str) -> str:
    """Sorted set of request ids accepted for a model and not yet finished (score: deadline)."""
    return f"{PREFIX}:inflight:{model}"


def rate_bucket(key_name: str, kind: str) -> str:
    """Hash of an API key's ``requests`` or ``tokens`` bucket: its level and when it was read."""
    return f"{PREFIX}:rate:{key_name}:{kind}"


def rate_running(key_name: str) -> str:
    """How many of an API key's requests are running now."""
    return f"{PREFIX}:rate:{key_name}:running"


JOB_INDEX = f"{PREFIX}:jobs"  # sorted set of async job ids by creation time
JOB_ACTIVE = f"{PREFIX}:jobs:active"  # set of async jobs not yet finished


def job_record(job_id: str) -> str:
    """Hash of an async job's record; its siblings below share its expiry."""
    return f"{PREFIX}:job:{job_id}"


def job_events(job_id: str) -> str:
    """Stream of a job's protocol chunks; entry ``n-0`` is SSE event ``n``."""
    return f"{job_record(job_id)}:events"


def job_runner(job_id: str) -> str:
    """The lease of the API process running a job (renewed; expires when it dies)."""
    return f"{job_record(job_id)}:runner"


def job_tombstone(job_id: str) -> str:
    """What remains of an expired job, for as long again as its retention."""
    return f"{job_record(job_id)}:tombstone"
