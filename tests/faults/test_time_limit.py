"""Fault matrix, the time limit: a one-task ``elastic_array`` job with ``--time=1`` and
``--signal=B:USR2@30``. Slurm's own timer sends the notice before the limit; the workers
checkpoint, the agent requeues its task, and the next run resumes from that checkpoint,
until training completes. Slow by nature (Slurm's 1-minute granularity, 30-s checks):
one case only, 2-4 minutes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic.slurm.jobstate import JobState
from tests.conftest import SlurmCluster
from tests.faults.harness import FaultRun
from tests.helpers import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]


def test_time_limit_notice_checkpoints_and_requeues(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run = FaultRun(
        slurm_cluster,
        tmp_path / "run",
        steps=300,  # ~45 s of paced training: longer than one run's notice window
        values={
            "nnodes": "1:1",
            "nproc_per_node": 1,
            "cpus_per_task": 1,
            "time": "1",
            "signal_lead_s": 30,
        },
    )
    try:
        run.submit()
        # Slurm's timer, not the test, sends the notice: wait for the requeue it causes.
        requeued = wait_for(
            lambda: run.events(0, "agent.requeued"),
            240,
            f"a time-limit requeue\n{run.logs()}",
            interval=1,
        )
        signals = [e for e in run.events(0, "agent.signal")]
        assert signals and signals[0]["signal"] == "USR2" and signals[0]["notice"], signals
        assert run.events(0, "train.preempted"), "the workers did not checkpoint on the notice"
        resumed = wait_for(
            lambda: [e for e in run.events(requeued[0]["time"], "train.start") if e["step"] > 0],
            240,
            f"the requeued task to resume from its checkpoint\n{run.logs()}",
            interval=1,
        )
        assert resumed[0]["step"] >= max(e["step"] for e in run.events(0, "train.preempted"))
        # the rest of the training runs paced too: it may take another notice or two
        info = slurm_cluster.wait_state(f"{run.job}_0", {s for s in JobState if s.is_terminal}, 400)
        assert info.state == JobState.COMPLETED, f"{info}\n{run.logs()}"
        assert (info.restarts or 0) >= 1
        run.check_end(tmp_path)
    finally:
        run.cleanup()
