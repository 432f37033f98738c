"""Async jobs: submit a generation now, fetch its result or stream its events later.

``routes`` is the HTTP API, ``manager`` runs and adopts jobs, ``runner``
turns one job's inference events into stored protocol chunks, ``store`` and
``redis_store`` keep records and events (in memory for the embedded mode,
in Redis for distributed mode), ``worker_queue`` runs a job's generation on
the workers in distributed mode, read back by whichever process holds the job.
"""
