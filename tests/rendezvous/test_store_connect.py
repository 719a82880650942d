"""An agent's connection to its round's store takes as long as the round lasts.

Real parts: a real TCPStore served by a separate process (tests/store_host.py), the
agent's real client path (``WorkerStoreOwner._client``). A slow host is that process
stopped with SIGSTOP and continued later: its kernel accepts the connection, nobody
answers until it runs again (as a host busy with thousands of connections, or a
resolver that takes seconds per lookup, makes it wait). And who spreads their connects:
agents that share rank 0's host, not agents on their own nodes (a real era directory and
rank 0's real store; the sleeps are recorded, and still slept).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.rendezvous import worker_store
from slurm_elastic.rendezvous.run_directory import Incarnation, RunDirectory
from slurm_elastic.rendezvous.worker_store import WorkerStoreOwner
from tests.helpers import wait_for
from tests.store_host import store_host


def owner(timeout_s: float) -> WorkerStoreOwner:
    # The era is only used to publish and read the store's record, not by the client.
    era: Any = None
    return WorkerStoreOwner(era, "node-a", "127.0.0.1", 0, timeout_s)


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the test ended (host killed) first
        os.kill(pid, signal.SIGCONT)


def test_a_connect_slower_than_ten_seconds_waits_while_the_round_is_current() -> None:
    """A host that answers after 11.5 s is reached at the first try. Before: every
    connect gave up after 10 s (whatever the store's timeout), so a host that needs
    longer (4,096 agents connecting, a slow reverse lookup) was never reached, and each
    retry added a connection to the pile."""
    with store_host() as (proc, port):
        os.kill(proc.pid, signal.SIGSTOP)
        wait_for(lambda: stopped(proc.pid), 10, "the store host to stop")
        start = time.monotonic()
        threading.Timer(11.5, resume, args=(proc.pid,)).start()
        rec = {"addr": "127.0.0.1", "port": port}
        client = owner(120.0)._client(rec, 1, lambda: True, time.monotonic() + 60.0)
        took = time.monotonic() - start
        client.set("k", "v")
        assert client.get("k") == b"v"
        assert 11.0 <= took < 30.0, took


def _round(tmp_path: Path, rank0_addr: str) -> tuple[Any, WorkerStoreOwner]:
    run = RunDirectory(tmp_path / "rdzv", "r")
    era = run.select_era(Incarnation("cohort", "key"))
    server = WorkerStoreOwner(era, "node-0", rank0_addr, 0, 30.0)
    server.setup(1, 0, "node-0", lambda: True, time.monotonic() + 30.0)
    return era, server


def _sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    slept: list[float] = []
    real = time.sleep

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        real(seconds)

    monkeypatch.setattr(worker_store.time, "sleep", sleep)
    return slept


def test_agents_on_their_own_hosts_connect_without_the_spread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 49 on another host than rank 0 (127.0.0.2; all of 127/8 is this machine's
    loopback) connects as soon as it reads the store's record. Before, every rank
    waited 10 ms x ((rank - 1) % 50) first, up to 0.49 s on every formation and
    re-formation of a job of 50 nodes or more, against a burst that only one host's
    resolver sees (agents that share a host)."""
    era, _rank0 = _round(tmp_path, "127.0.0.1")  # keeps serving while referenced
    slept = _sleeps(monkeypatch)
    client = WorkerStoreOwner(era, "node-49", "127.0.0.2", 0, 30.0)
    store, info = client.setup(1, 49, "node-0", lambda: True, time.monotonic() + 30.0)
    store.set("k", "v")
    assert info.master_addr == "127.0.0.1"
    assert max(slept, default=0.0) < 0.1, slept


def test_agents_that_share_rank_0s_host_spread_their_connects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Agents on rank 0's own host (one machine's test or simulation) still spread their
    connects (rank 49 waits 0.48 s): this machine's resolver drops bursts of reverse
    lookups, and each dropped one costs 5 s."""
    era, _rank0 = _round(tmp_path, "127.0.0.1")  # keeps serving while referenced
    slept = _sleeps(monkeypatch)
    client = WorkerStoreOwner(era, "node-49", "127.0.0.1", 0, 30.0)
    store, _ = client.setup(1, 49, "node-0", lambda: True, time.monotonic() + 30.0)
    store.set("k", "v")
    assert slept.count(0.48) == 1, slept
