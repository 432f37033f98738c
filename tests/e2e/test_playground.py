"""The playground page in headless Chromium, against a server that wants an API key: a user
types the key and a message, and reads the answer streamed from ``/v1/chat/completions``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.browser import CHROMIUM, chromium_page
from tests.servers import COMPILED, running_server

KEY = "sk-playground"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package"),
]


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = ["--max-model-len", "2048", "--max-num-seqs", "2", "--api-key", KEY]
    with running_server(args, tmp_path_factory.mktemp("keyed"), COMPILED) as base_url:
        yield base_url


def test_a_typed_message_streams_its_answer(keyed_server: str, tmp_path: Path):
    root = httpx.get(f"{keyed_server}/")  # open: the page's own calls carry the key
    assert root.status_code == 307 and root.headers["location"] == "/playground/"
    with chromium_page(f"{keyed_server}/", tmp_path / "profile") as page:
        page.wait_for("document.title === 'Sluice playground'", 10, "the playground")
        page.wait_for("document.getElementById('status').textContent", 10, "the key refusal")
        page.type_into("#api-key", KEY)
        page.evaluate("document.getElementById('api-key').dispatchEvent(new Event('change'))")
        model = page.wait_for("document.getElementById('model').value", 10, "the model list")
        page.evaluate(
            "document.getElementById('temperature').value = '0';"
            "document.getElementById('max-tokens').value = '12';"
        )
        page.type_into("#system", "Answer in one short sentence.")
        page.type_into("#message", "Name a colour of the sea.")
        page.press_enter()
        stats = page.wait_for(
            "document.querySelector('.turn.assistant .stats')?.textContent", 60, "the answer"
        )
        answer = page.evaluate("document.querySelector('.turn.assistant .text').textContent")
        user = page.evaluate("document.querySelector('.turn.user .text').textContent")
        page.screenshot(tmp_path / "playground.png")
    assert user == "Name a colour of the sea."
    expected = httpx.post(
        f"{keyed_server}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={
            "model": model,
            "messages": [
                {"role": "system", "content": "Answer in one short sentence."},
                {"role": "user", "content": "Name a colour of the sea."},
            ],
            "temperature": 0,
            "max_tokens": 12,
        },
        timeout=60,
    ).json()
    reply = expected["choices"][0]["message"]["content"]
    assert answer == reply and answer, json.dumps(expected)
    usage = expected["usage"]
    assert f"{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion" in stats
    assert "first token" in stats and (tmp_path / "playground.png").stat().st_size > 1000
