"""call_bounded: a call to a frozen store host is abandoned instead of waited for forever.

Real parts: a real TCPStore served by a separate process (tests/store_host.py), stopped
with SIGSTOP, and torch's real client.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from slurm_elastic.rendezvous.bounded_call import StoreUnansweredError, call_bounded
from tests.store_host import store_host


def connect(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=1))


def test_a_connect_to_a_frozen_host_is_abandoned_at_the_limit() -> None:
    """torch's constructor waits for the frozen host's ping answer without a timeout."""
    with store_host() as (proc, port):
        os.kill(proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(StoreUnansweredError, match="within 2 s: its host is frozen"):
            call_bounded(lambda: connect(port), limit_s=2.0, slice_s=0.2)
        assert 2.0 <= time.monotonic() - start < 4.0


def test_a_call_is_abandoned_once_its_caller_gives_up() -> None:
    with store_host() as (proc, port):
        client = connect(port)
        os.kill(proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        reasons = iter([None, None, "round 3 ended"])
        with pytest.raises(StoreUnansweredError, match="no answer from the store, and round 3"):
            call_bounded(lambda: client.check(["k"]), limit_s=60, give_up=lambda: next(reasons),
                         slice_s=0.2)  # fmt: skip
        assert time.monotonic() - start < 5.0


def test_answers_and_errors_come_back_as_they_are() -> None:
    with store_host() as (proc, port):
        client = connect(port)
        assert call_bounded(lambda: client.set("k", "v"), limit_s=10) is None
        assert call_bounded(lambda: client.get("k"), limit_s=10) == b"v"
        proc.kill()
        proc.wait(timeout=30)
        with pytest.raises(dist.DistError):  # a dead host: torch's own error, at once
            call_bounded(lambda: client.get("k"), limit_s=30)
