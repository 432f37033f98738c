"""Async jobs: submit a generation now, fetch its result or stream its events later.

``routes`` is the HTTP API, ``manager`` runs and adopts jobs, ``runner``
turns one job's inference events into stored protocol chunks, ``store`` and
``redis_store`` keep records and events (in memory for the embedded mode,
in Redis for distributed mode). In distributed mode a job's generation runs
on the workers through the process's request channel
(``api.backends.channel``), read back by whichever process holds the job.
"""
