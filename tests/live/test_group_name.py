"""A worker whose group formation failed forms the next round with a fresh process.

Seen in CI (tests/live/test_in_place.py's spare promotion, twice): a member left while a
newcomer joined; the survivor's workers switched to the one-node round, whose store went
away under them as the next round (survivor + newcomer) formed, and then waited 90 s
with the newcomer's workers in that round's store. torch names the default group by a
process-wide counter that a failed ``init_process_group`` advances: the survivor formed
round 2 as group ``1``, the newcomer as ``0``, and each waited for the other's keys.
:func:`slurm_elastic.live.world.form_group` resets the name after a failure.

Real processes, real gloo groups over a real TCPStore (tests/live/group_name_worker.py).
"""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers import wait_for

WORKER = Path(__file__).with_name("group_name_worker.py")

pytestmark = pytest.mark.timeout(180)


def test_a_failed_formation_does_not_rename_the_next_group(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    outs = {role: tmp_path / f"{role}.out" for role in ("survivor", "newcomer")}
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(role: str) -> None:
        with open(outs[role], "wb") as out:
            procs[role] = subprocess.Popen(
                [sys.executable, str(WORKER), str(store.port), role],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    try:
        start("survivor")
        wait_for(lambda: "FIRST_FAILED" in outs["survivor"].read_text(), 60, "round 1 to fail")
        start("newcomer")  # a fresh process: its group name counter is at 0
        for role, proc in procs.items():
            # round 2's formation waits 20 s: a mismatch fails it, it does not hang
            assert proc.wait(60) == 0, f"{role}:\n{outs[role].read_text()}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    for role in procs:
        assert "SUM 2.0" in outs[role].read_text(), f"{role}:\n{outs[role].read_text()}"
