"""One log line format for every Sluice process (API, worker)."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(level: str = "INFO") -> None:
    """Show the project's own log lines at ``level`` and above on standard error."""
    logging.basicConfig(level=level.upper(), format=FORMAT)
