"""Fault matrix, slurmctld restarted mid-run.

The controller is stopped (SIGTERM, as its init script does) and started again with the
command ``scripts/slurm-cluster up`` uses (``slurmctld -f <conf>``); it restores its jobs
from ``StateSaveLocation``. Running jobs do not depend on it (slurmd and the agents go
on), so training must not even notice; after the restart Slurm must still act on the job
(a ``scontrol requeue`` of one task, which rejoins), and the run completes exactly.

Other users' jobs on a shared test cluster see the controller gone for ~1 s (their
Slurm commands retry); the test keeps the outage short and always starts it again.
Only for the local cluster of scripts/slurm-cluster (it reads the pid file there).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from slurm_elastic.slurm.jobstate import JobState
from tests.conftest import SlurmCluster
from tests.faults.harness import FaultRun
from tests.helpers import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def restart_slurmctld(cluster: SlurmCluster) -> None:
    conf = Path(cluster.env["SLURM_CONF"])
    pid_file = conf.parent / "run" / "slurmctld.pid"
    pid = int(pid_file.read_text().split()[0])
    os.kill(pid, signal.SIGTERM)
    try:
        wait_for(lambda: not _pid_alive(pid), 30, "slurmctld to stop", interval=0.05)
    finally:
        # always start it again, even if it did not stop in time (a second one refuses)
        subprocess.run(["slurmctld", "-f", str(conf)], check=True, env=cluster.env, timeout=60)
    wait_for(cluster.client.ping, 30, "slurmctld to answer again", interval=0.1)


def test_training_survives_a_slurmctld_restart(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    if slurm_cluster.mode == "external":
        why = "restarts the controller: only on the local cluster of scripts/slurm-cluster"
        pytest.skip(reason=why)
    run = FaultRun(
        slurm_cluster,
        tmp_path / "run",
        steps=400,
        values={"nnodes": "1:2", "nproc_per_node": 1, "cpus_per_task": 1},
    )
    try:
        run.submit()
        run.wait_training(2, 0, 240, "the run")
        before, t_restart = run.step_now(), time.time()
        restart_slurmctld(slurm_cluster)
        wait_for(lambda: run.step_now() > before + 10, 60, "training to go on after the restart")
        assert not run.events(t_restart, "agent.restart"), (
            "the workers were restarted by the outage"
        )
        infos = run.infos()
        assert {i.state for i in infos} == {JobState.RUNNING}, infos
        # Slurm still acts on the job after the restart
        t0 = time.time()
        slurm_cluster.client.requeue(f"{run.job}_1")
        run.wait_training(1, t0, 240, "the survivor after the requeue", new_round=True)
        run.wait_training(2, t0, 240, "the requeued task to rejoin", new_round=True)
        infos = run.finish()
        assert {i.state for i in infos} == {JobState.COMPLETED}, f"{infos}\n{run.logs()}"
        run.check_end(tmp_path)
    finally:
        run.cleanup()
