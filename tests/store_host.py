"""A real TCPStore served by a separate process, for tests of a store host that is alive,
dead or frozen (SIGSTOP: its kernel still accepts requests and nobody answers them, as on
a hung node)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

SERVE = """
import time
from datetime import timedelta
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                  timeout=timedelta(seconds=60), use_libuv=True)
print(s.port, flush=True)
time.sleep(600)
"""


@contextmanager
def store_host() -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A process serving a TCPStore on 127.0.0.1, and its port (killed at the end, stopped
    or not)."""
    proc = subprocess.Popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield proc, int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(timeout=30)
