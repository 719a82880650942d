"""``slurm_elastic.procstat``: the one reader of ``/proc/<pid>/stat`` (real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from slurm_elastic import procstat
from tests.helpers import wait_for


def test_reads_parent_and_start_time_and_sees_a_stopped_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        first = procstat.read(child.pid)
        assert first is not None and first.ppid == os.getpid() and not first.stopped
        os.kill(child.pid, signal.SIGSTOP)
        wait_for(lambda: procstat.read(child.pid).stopped, 10, "the child stopped")  # type: ignore[union-attr]
        stopped = procstat.read(child.pid)
        assert stopped is not None and stopped.start_time == first.start_time
        os.kill(child.pid, signal.SIGCONT)
        wait_for(lambda: not procstat.read(child.pid).stopped, 10, "the child running")  # type: ignore[union-attr]
    finally:
        child.kill()
        child.wait()
    assert procstat.read(child.pid) is None  # reaped: gone


def test_a_command_name_with_parentheses_keeps_the_fields_in_place(tmp_path: Path) -> None:
    odd = tmp_path / "a b) (c"
    odd.symlink_to(sys.executable)
    child = subprocess.Popen([str(odd), "-c", "import time; time.sleep(60)"])
    try:
        found = procstat.read(child.pid)
        assert found is not None and found.ppid == os.getpid() and found.state in "RSD"
    finally:
        child.kill()
        child.wait()
