"""One hung worker on one node (issue 22): its agent's hang watchdog acts, the other
node stays in place.

Node ``b``'s rank-1 worker is stopped (SIGSTOP: alive, sockets open, no progress). Every
other worker waits in the collective for it. ``b``'s agent sees no progress for
``hang_timeout_s`` (3 s here), restarts its workers (torch's restart: the stopped one is
killed), and the killed worker's sockets reset the others' collective. Node ``a``'s
workers keep their processes: they re-form in place with ``b``'s new workers, which get
the state from ``a``. At most the step in flight is redone, every sample is used once
per epoch, and the parameters match the uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from slurm_elastic.agent import ExitCode
from slurm_elastic.events import read_events
from tests.helpers import wait_for
from tests.live.conftest import (
    LiveRun,
    assert_close_to_reference,
    assert_each_sample_once,
    ledger,
    redone_steps,
    wait_world_of_4,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

HANG_TIMEOUT_S = 3.0


def test_a_hung_worker_is_restarted_by_its_agent_and_the_other_node_stays_in_place(
    tmp_path: Path, nodes: list[LiveRun]
) -> None:
    steps, run_id = 300, "hung"
    args = ("--hang-timeout", str(HANG_TIMEOUT_S), "--max-restarts", "1")
    a = LiveRun(tmp_path, run_id, "2:2", "a", steps=steps, agent_args=args)
    b = LiveRun(tmp_path, run_id, "2:2", "b", steps=steps, agent_args=args)
    nodes += [a, b]
    wait_world_of_4(tmp_path, min_steps=20)
    a_pids, b_pids = a.worker_pids(), b.worker_pids()
    hung = max(b_pids)
    stopped_at = time.time()
    os.kill(hung, signal.SIGSTOP)

    def a_step_with_new_b_workers() -> float | None:
        after = [
            r
            for r in ledger(tmp_path)
            if r["time"] > stopped_at and r["world"] == 4 and r["pid"] not in a_pids | b_pids
        ]
        return min((r["time"] for r in after), default=None)

    first = wait_for(a_step_with_new_b_workers, 90, "a step of b's new workers")
    print(f"hung worker: world of 4 again {first - stopped_at:.2f} s after the stop")

    assert a.wait(150) == ExitCode.FINISHED, a.log()
    assert b.wait(30) == ExitCode.FINISHED, b.log()
    records = ledger(tmp_path)
    a_after = {r["pid"] for r in records if r["time"] > first and r["pid"] in a_pids}
    assert a_after == a_pids, "node a's workers must keep their processes"
    b_after = {r["pid"] for r in records if r["time"] > first and r["pid"] not in a_pids}
    assert len(b_after) == 2 and not b_after & b_pids, "b's workers must be new ones"
    assert redone_steps(records) <= 1  # the step in flight at most
    assert_each_sample_once(records, steps)
    assert_close_to_reference(tmp_path, steps)
    events = list(read_events(tmp_path / "state" / "events" / run_id))
    hangs = [e for e in events if e["kind"] == "agent.hang"]
    assert [e["pid"] for e in hangs] == [b.proc.pid], "only b's hang watchdog acts"
    restarts = [e for e in events if e["kind"] == "agent.restart" and e["pid"] == b.proc.pid]
    # its own failure: charged at once, not after waiting the eviction window (5 s) for
    # a membership change (its own leave is none)
    assert restarts and restarts[0]["reason"] == "failure", restarts
    assert restarts[0].time - hangs[0].time < 2.5, (hangs[0].time, restarts[0].time)
    reformed = [e for e in events if e["kind"] == "live.reformed" and e["pid"] in a_pids]
    assert reformed, "a's workers must have re-formed in place"
