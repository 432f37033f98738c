"""Sequences of calls against the embedded server: files, batches, responses and jobs.

The server of this module runs with three API keys, files of at most 2 KiB,
4 KiB and three files a key, and an 8 s batch completion window, so that a
few steps reach another key's objects, the quota edges and expired batches.
The state machine is ``tests.fuzz_sequences``' (the distributed test runs the
same one); what each step checks is written there. Twenty sequences of up to
eighty steps, the same ones on every run (``derandomize``), take about 30 s
on two cores; ``SLUICE_FUZZ_SCALE=10`` (``make soak``) runs ten times as
many for a deeper search, and ``SLUICE_FUZZ_SHRINK=1`` shrinks a failing
sequence. The
run prints the number of calls and the ``/health`` latencies seen meanwhile
(``-s`` shows them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from tests.fuzz_sequences import Target, run_sequences, server_options
from tests.servers import running_server

pytestmark = pytest.mark.slow

KEYS = ("sk-sequences-a", "sk-sequences-b", "sk-sequences-c")
SEQUENCES, STEPS = 20, 80


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    target = Target("", KEYS)
    args = ["--max-model-len", "1024", "--max-num-seqs", "4", *server_options(target)]
    with running_server(args, tmp_path_factory.mktemp("sequences")) as base_url:
        yield dataclasses.replace(target, base_url=base_url)


def test_sequences_of_calls_keep_every_invariant(target: Target):
    run_sequences(target, SEQUENCES, STEPS, "embedded")
