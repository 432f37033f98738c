"""Sequences of calls against the distributed server: files, batches, responses and jobs.

The same state machine as the embedded test (``tests.fuzz_sequences``), run
against the real API process in front of the session's Redis and workers: the
API restarts with three API keys, files of at most 2 KiB, 4 KiB and three
files a key, and an 8 s batch completion window. Files, batches, stored
responses and jobs live in Redis here, and generation happens on the
workers, so the machine checks the shared stores' ownership, quotas and
cursors. Every sequence starts by deleting the files the sequences before it
uploaded; what else they made stays in Redis and must keep to its key (jobs
made without a key by other tests are everyone's, and are left alone).
Twenty sequences of up to eighty steps take about 30 s on two cores;
``SLUICE_FUZZ_SCALE=10`` (``make soak``) runs ten times as many, and
``SLUICE_FUZZ_SHRINK=1`` shrinks a failing sequence.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.distributed.conftest import API_OPTIONS, Api, Fleet
from tests.fuzz_sequences import Target, run_sequences, server_options

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

KEYS = ("sk-sequences-a", "sk-sequences-b", "sk-sequences-c")
SEQUENCES, STEPS = 20, 80


@pytest.fixture
def target(api_process: Api, fleet: Fleet) -> Target:
    """The API with the keys and limits of ``Target``, both workers live."""
    target = Target("", KEYS)
    base_url = api_process.ensure(*API_OPTIONS, *server_options(target))
    fleet.top_up()
    fleet.wait_live()
    return dataclasses.replace(target, base_url=base_url)


def test_sequences_of_calls_keep_every_invariant(target: Target):
    run_sequences(target, SEQUENCES, STEPS, "distributed")
