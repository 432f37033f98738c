"""A real HTTP server on a loopback address that serves test images and records every request.

SSRF tests point refused URLs at it: a refusal is proven by the server having
received no request at all, not by the client's error message alone.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from PIL import Image


def png_bytes(width: int = 32, height: int = 24, color: tuple[int, ...] = (200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB" if len(color) == 3 else "RGBA", (width, height), color).save(buffer, "PNG")
    return buffer.getvalue()


@dataclass
class ImageServer:
    """``base`` is ``http://HOST:PORT``; ``paths`` are the request paths received, in order."""

    host: str
    port: int
    paths: list[str] = field(default_factory=list)
    image: bytes = field(default_factory=png_bytes)

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"


@contextmanager
def image_server(host: str = "127.0.0.1") -> Iterator[ImageServer]:
    """Serves ``/image.png``, ``/redirect?to=URL``, ``/status/N``, ``/slow``, ``/page.html``,
    ``/garbage.png`` (an image content type over bytes that are not one) and ``/large.png``."""
    server = ImageServer(host, 0)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the standard library's name
            server.paths.append(self.path)
            path, _, query = self.path.partition("?")
            if path == "/image.png":
                self._answer(200, "image/png", server.image)
            elif path == "/redirect":
                self.send_response(302)
                self.send_header("Location", query.removeprefix("to="))
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif path.startswith("/status/"):
                self._answer(int(path.rsplit("/", 1)[1]), "text/plain", b"no")
            elif path == "/slow":
                time.sleep(3)
                self._answer(200, "image/png", server.image)
            elif path == "/page.html":
                self._answer(200, "text/html", b"<html></html>")
            elif path == "/garbage.png":
                self._answer(200, "image/png", b"\x89PNG not really")
            elif path == "/large.png":
                self._answer(200, "image/png", bytes(4 * 2**20))
            else:
                self._answer(404, "text/plain", b"not found")

        def _answer(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with suppress(BrokenPipeError, ConnectionResetError):
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    http = ThreadingHTTPServer((host, 0), Handler)
    http.daemon_threads = True
    server.port = http.server_address[1]
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        http.shutdown()
        http.server_close()
