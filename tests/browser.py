"""Headless Chromium driven over the DevTools protocol: open a page, type, read it.

Debian's ``chromium`` package is the browser; the protocol goes over one
WebSocket to the page (``websockets``' synchronous client), so no driver
binary or browser-automation package is needed.
"""

from __future__ import annotations

import base64
import itertools
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

CHROMIUM = shutil.which("chromium")
STARTUP_TIMEOUT_S = 30
_LISTENING = re.compile(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/")


class Page:
    """One tab: every command waits for its own answer."""

    def __init__(self, socket: ClientConnection) -> None:
        self._socket = socket
        self._ids = itertools.count(1)

    def command(self, method: str, **params: Any) -> dict[str, Any]:
        message_id = next(self._ids)
        self._socket.send(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            answer = json.loads(self._socket.recv(timeout=60))
            if answer.get("id") == message_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})

    def evaluate(self, expression: str) -> Any:
        result = self.command("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float, what: str) -> Any:
        """Poll ``expression`` until it is truthy; one that throws (the page is still
        loading) counts as not yet."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                value = self.evaluate(expression)
            except RuntimeError:
                value = None
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")

    def type_into(self, selector: str, text: str) -> None:
        """Focus the element and type ``text`` as a keyboard would insert it."""
        self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        self.command("Input.insertText", text=text)

    def press_enter(self) -> None:
        key = {"key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13}
        self.command("Input.dispatchKeyEvent", type="keyDown", text="\r", **key)
        self.command("Input.dispatchKeyEvent", type="keyUp", **key)

    def screenshot(self, path: Path) -> None:
        data = self.command("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))


@contextmanager
def chromium_page(url: str, profile: Path) -> Iterator[Page]:
    """A headless Chromium showing ``url``; closed on exit."""
    assert CHROMIUM, "no chromium on PATH"
    process = subprocess.Popen(
        [
            CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
            "--remote-debugging-port=0", f"--user-data-dir={profile}",
            "--window-size=1000,700", "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        port = _devtools_port(process)
        target = httpx.put(f"http://127.0.0.1:{port}/json/new?{url}", timeout=10).json()
        with connect(target["webSocketDebuggerUrl"], max_size=2**26) as socket:
            page = Page(socket)
            page.wait_for("document.readyState === 'complete'", 20, "the page to load")
            yield page
    finally:
        process.kill()
        process.wait()


def _devtools_port(process: subprocess.Popen) -> int:
    assert process.stderr is not None
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    seen = []
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line and process.poll() is not None:
            break
        seen.append(line)
        match = _LISTENING.search(line)
        if match:
            return int(match.group(1))
    raise AssertionError("chromium did not start:\n" + "".join(seen))
