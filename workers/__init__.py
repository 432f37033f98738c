"""GPU workers for distributed mode: Celery jobs in, Redis Streams of events out.

``main`` starts one (``sluice worker``); ``app`` configures Celery, ``task``
runs a job, ``host`` owns the engine thread, ``publisher`` writes fenced
events, ``cancellation``, ``heartbeat`` and ``visibility`` keep the rest of
the system informed. Nothing here imports ``api``.
"""
