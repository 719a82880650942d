"""Fault matrix, the time limit: a one-task ``elastic_array`` job with ``--time=2`` and
``--signal=B:USR2@45``. Slurm's own timer sends the notice before the limit; the workers
checkpoint, the agent requeues its task, and the next run resumes from that checkpoint,
until training completes. Slow by nature (Slurm's 1-minute granularity, 30-s checks):
one case only, 3-5 minutes.

``--time=1 --signal=B:USR2@30`` was tried first: Slurm (which may signal up to ~60 s
early) sent the notice 8 s after the start, before the agent had installed its handler,
and the task died of the signal (``FAILED``, ``JobLaunchFailure``, exit ``0:12``), not
requeued. ``test_a_notice_during_start_up_does_not_lose_the_task`` reproduces that (a
USR2 as soon as the task runs); since the fix the script holds an early notice (ignored
and blocked across the ``exec``) and the agent acts on it once its handler exists: the
task requeues itself and completes. The test signals as soon as the script holds the
notice (``batch_script_holds``), not merely at ``RUNNING``: it failed once in CI
(2026-12-03, 0 requeues, no signal seen by the agent) with the notice sent right after
``RUNNING``, which can land in one of two documented gaps (Slurm's, before the batch step
exists; ours, the re-run's ``exec``; ``docs/reliability.md``).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from slurm_elastic.slurm.jobstate import JobState
from tests.conftest import SlurmCluster
from tests.faults.harness import FaultRun, batch_script_holds
from tests.helpers import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]


def test_time_limit_notice_checkpoints_and_requeues(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run = FaultRun(
        slurm_cluster,
        tmp_path / "run",
        steps=500,  # ~75 s of paced training: longer than one run's notice window
        values={
            "nnodes": "1:1",
            "nproc_per_node": 1,
            "cpus_per_task": 1,
            "time": "2",
            "signal_lead_s": 45,
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
        assert signals and signals[0]["signal"] == "SIGUSR2" and signals[0]["notice"], signals
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


def test_a_notice_during_start_up_does_not_lose_the_task(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run = FaultRun(
        slurm_cluster,
        tmp_path / "run",
        steps=100,
        values={"nnodes": "1:1", "nproc_per_node": 1, "cpus_per_task": 1},
    )
    try:
        run.submit()
        started = slurm_cluster.wait_state(f"{run.job}_0", {JobState.RUNNING}, 240)
        # Send it as soon as it cannot be lost by design (batch_script_holds): not in the
        # gap before Slurm starts the batch step, nor in the script's re-run exec.
        wait_for(
            lambda: batch_script_holds(started.job_id, signal.SIGUSR2),
            60,
            "the batch script to hold the notice",
            interval=0.005,
        )
        slurm_cluster.client.cancel(f"{run.job}_0", signal="USR2", batch=True)
        info = slurm_cluster.wait_state(f"{run.job}_0", {s for s in JobState if s.is_terminal}, 400)
        assert info.state == JobState.COMPLETED, f"{info}\n{run.logs()}"
        assert (info.restarts or 0) >= 1, f"the early notice was lost (no requeue)\n{run.logs()}"
        run.finish()
        run.check_end(tmp_path)
    finally:
        run.cleanup()
