"""Backends run prepared requests: embedded (the engine in this process) or queued.

Routes depend only on ``Backend`` from ``base``; the embedded backend is
imported by whoever builds the app, so distributed mode never loads torch.
"""

from api.backends.base import Backend, BackendHealth, ServedModel

__all__ = ["Backend", "BackendHealth", "ServedModel"]
