"""An agent's connection to its round's store takes as long as the round lasts.

Real parts: a real TCPStore served by a separate process (tests/store_host.py), the
agent's real client path (``WorkerStoreOwner._client``). A slow host is that process
stopped with SIGSTOP and continued later: its kernel accepts the connection, nobody
answers until it runs again (as a host busy with thousands of connections, or a
resolver that takes seconds per lookup, makes it wait).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any

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
