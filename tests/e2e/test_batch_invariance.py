"""A greedy request gets the same answer alone as among 31 others, through the official SDK.

The server runs the default configuration (bfloat16 with the GGUF's low-bit
weights, compiled decode steps) with room for 32 sequences at once, so the
crowd shares every step with the requests being checked: their prompts are
prefilled in chunks beside other prompts and decodes, and they decode in
batches of every size as the crowd finishes unevenly. Where the engine's own
kernels do not run, a row's logits round with the rows beside it and the engine
promises no such thing, so the test is skipped there, as the engine's is.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from engine.precision import own_kernels_run
from tests.servers import COMPILED, running_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not own_kernels_run(), reason="the batch-invariant kernels do not run here"),
]

CHECKED = [
    "Write a short story about a lighthouse keeper.",
    "Explain how rain forms, step by step.",
    "List five uses of a paperclip.",
    "What is the capital of France? Tell me about it.",
    "Describe the sea at night.",
    "Write a haiku about autumn, then explain it.",
    "How do bees make honey?",
    "Give me three tips for learning to play the piano.",
]
CROWD = [f"Count from {n} to {n + 30}, then say something about the number {n}." for n in range(24)]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAI]:
    args = ["--max-model-len", "2048", "--max-num-seqs", "32"]
    with running_server(args, tmp_path_factory.mktemp("invariance"), COMPILED) as base_url:
        yield OpenAI(base_url=f"{base_url}/v1", api_key="sk-local", max_retries=0, timeout=300)


def _answer(client: OpenAI, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    completion = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return completion.choices[0].message.content


def test_greedy_answers_do_not_depend_on_the_requests_beside_them(client: OpenAI) -> None:
    alone = [_answer(client, prompt) for prompt in CHECKED]
    crowd_lengths = [16 + 7 * i % 90 for i in range(len(CROWD))]  # they finish unevenly
    with ThreadPoolExecutor(len(CHECKED) + len(CROWD)) as pool:
        crowd = [
            pool.submit(_answer, client, prompt, tokens)
            for prompt, tokens in zip(CROWD, crowd_lengths, strict=True)
        ]
        together = list(pool.map(lambda prompt: _answer(client, prompt), CHECKED))
        for future in crowd:
            future.result()
    for prompt, expected, got in zip(CHECKED, alone, together, strict=True):
        assert got == expected, prompt
