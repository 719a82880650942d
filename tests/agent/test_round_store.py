"""The round's store for rank assignment against a store host that is alive, dead or frozen.

Real parts: a real TCPStore served by a separate process (tests/store_host.py), a real
client. A frozen host is that process stopped with SIGSTOP.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from slurm_elastic.agent.round_store import RoundBoundStore
from slurm_elastic.errors import RoundLostError
from tests.store_host import store_host


@pytest.fixture
def host() -> Iterator[tuple[subprocess.Popen[str], int]]:
    with store_host() as served:
        yield served


def client(port: int, timeout_s: float) -> dist.Store:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    store.set_timeout(timedelta(seconds=timeout_s))
    return dist.PrefixStore("round.1", store)


def call_within(fn: Any, limit_s: float) -> tuple[Any, BaseException | None, float]:
    """``fn()`` on a thread; its result or error and how long it took. Fails (instead of
    hanging the suite) when it has not returned within ``limit_s``."""
    box: list[tuple[Any, BaseException | None]] = []

    def run() -> None:
        try:
            box.append((fn(), None))
        except BaseException as exc:
            box.append((None, exc))

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert box, f"the call did not return within {limit_s} s"
    return box[0][0], box[0][1], time.monotonic() - start


def test_reads_wait_for_keys_written_later(host: tuple[subprocess.Popen[str], int]) -> None:
    _, port = host
    store = RoundBoundStore(client(port, 30.0), lambda: False, ask_every_s=0.1)
    writer = client(port, 30.0)
    store.set("a", "1")
    threading.Timer(0.3, lambda: writer.multi_set(["b", "c"], ["2", "3"])).start()
    value, error, _ = call_within(lambda: store.multi_get(["a", "b", "c"]), 20)
    assert error is None and value == [b"1", b"2", b"3"]


def test_a_frozen_store_host_does_not_hold_a_broken_round(
    host: tuple[subprocess.Popen[str], int],
) -> None:
    """The host froze before the other agents' writes: the wait for its answer ends once
    the rendezvous says the round lost a member (before the fix: for good)."""
    proc, port = host
    lost_at = [float("inf")]
    store = RoundBoundStore(
        client(port, 60.0), lambda: time.monotonic() >= lost_at[0], ask_every_s=0.1
    )
    os.kill(proc.pid, signal.SIGSTOP)
    lost_at[0] = time.monotonic() + 1.0  # the rendezvous evicts the host a second later
    _, error, took = call_within(lambda: store.get("ranks/1"), 30)
    assert isinstance(error, RoundLostError), error
    assert "no answer from the store, and the round lost a member" in str(error)
    assert 0.9 <= took < 5.0, took  # not before the round was lost (1 s after the start)


def test_a_frozen_store_host_fails_the_call_after_the_stores_timeout(
    host: tuple[subprocess.Popen[str], int],
) -> None:
    """Nobody says the round is lost: the call ends as a lost round after the store's own
    timeout (torch's client would wait for the frozen host's answer for good)."""
    proc, port = host
    store = RoundBoundStore(client(port, 1.0), lambda: False, ask_every_s=0.1)
    os.kill(proc.pid, signal.SIGSTOP)
    _, error, took = call_within(lambda: store.multi_get(["ranks/0", "ranks/1"]), 30)
    assert isinstance(error, RoundLostError), error
    assert "within 1 s" in str(error) and "frozen" in str(error)
    assert took < 10.0, took


def test_a_dead_store_host_is_a_lost_round(host: tuple[subprocess.Popen[str], int]) -> None:
    proc, port = host
    store = RoundBoundStore(client(port, 30.0), lambda: False, ask_every_s=0.1)
    proc.kill()
    proc.wait(timeout=30)
    _, error, took = call_within(lambda: store.get("ranks/1"), 30)
    assert isinstance(error, RoundLostError), error
    assert took < 10.0, took
