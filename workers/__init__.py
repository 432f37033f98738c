"""GPU workers for distributed mode: Celery jobs in, Redis Streams of events out.

``main`` starts one (``sluice worker``); ``broker`` holds everything Sluice
changes in Celery and kombu (taking, recording and starting jobs, the
Celery app); ``task`` runs a job; ``host`` owns the engine thread;
``outbox`` and ``publisher`` write fenced events; ``cancellation`` stops
what clients left; ``heartbeat`` keeps the worker in its model's registry
and hands back the jobs of dead workers; ``runtime`` starts and stops all
of it. Nothing here imports ``api``.
"""
