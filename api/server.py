"""Run the HTTP server: ``sluice serve`` and ``python -m api.server`` land here.

The app answers ``/health`` at once and ``/ready`` with 503 while the engine
thread loads the model, so an orchestrator can tell "starting" from "dead". A
model that fails to load, or an engine that dies, stops the server with exit
status 1 and the reason on stderr.
"""

from __future__ import annotations

import os
import sys

import uvicorn

from api.app import create_app
from api.connection_limits import GuardedHttpProtocol
from api.settings import Settings
from shared import logs

EXIT_BACKEND_FAILED = 1


def run(settings: Settings) -> int:
    """Build the app for ``settings`` and serve it until interrupted; the exit status."""
    # Preparation encodes a prompt's independent plain spans as one batch, which
    # the tokenizer spreads over the cores (about 0.7x the single-core latency
    # on 2 cores); this process never forks after that, so its threads are safe.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    # One format for the project's lines and uvicorn's (log_config=None: uvicorn's loggers
    # reach the root's handler); requests are logged once, by api.access_log.
    logs.configure(settings.log_level.upper(), settings.log_format)
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        root_path=settings.root_path,
        ssl_keyfile=str(settings.ssl_keyfile) if settings.ssl_keyfile else None,
        ssl_certfile=str(settings.ssl_certfile) if settings.ssl_certfile else None,
        log_level=settings.uvicorn_log_level,
        log_config=None,
        access_log=False,
        http=GuardedHttpProtocol.configured(settings.header_timeout_s, settings.max_header_bytes),
        timeout_keep_alive=settings.keep_alive_timeout_s,
    )
    server = uvicorn.Server(config)
    serving = app.state.serving
    serving.on_failure = lambda: setattr(server, "should_exit", True)
    server.run()
    if serving.failure is not None:
        print(f"sluice serve: {serving.failure}", file=sys.stderr)
        return EXIT_BACKEND_FAILED
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m api.server [serve options]``: the same options as ``sluice serve``."""
    from api.cli import main as cli_main

    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
