"""The early-notice race (issue #22 item 7): a notice at each phase of a task's start-up.

A preemption notice (``--signal=B:USR2@lead``, or ``scancel --signal=USR2 --batch`` as
here) can reach the batch shell at any moment after it started, also before the agent
can act on it. The guarantee under test: **a notice delivered to the batch shell after
its first line never ends the task unrequeued and is never lost**: the task requeues
itself, and nothing trained is lost (the run completes with every sample once per epoch
and the parameters of an uninterrupted run; a step trained before the notice would be
in the checkpoint the agent's workers save on it).

Each case pauses one ``elastic_array`` task at one phase through the start-up test seam
(``SLURM_ELASTIC_TEST_PAUSE_AT``: ``slurm_elastic/_startup_seam.py`` and the job
script's ``slurm_elastic_test_pause``), sends the notice there, waits until the target
process shows it *held* (pending in ``/proc/<pid>/status`` while blocked) or the agent
*acted* on it (its ``agent.signal`` event), and only then lets start-up go on:

* ``shell``: the batch shell after ``setup``, before the hand-over to the agent;
* ``exec``: the hand-over itself (before the fix the notice was ignored there: dropped);
* ``agent_start``: the agent's process before its handler exists (Python starting);
* ``rendezvous``: the agent in a formed round, its workers not started;
* ``workers_start``: the workers just started (importing torch, no step trained).

In every phase no step was trained before the notice, so the right outcome is: the task
requeues itself once (``agent.requeued`` in its first run, ``Restarts >= 1``), its
first run trained nothing, and the requeued run trains to the end. Only the seam is not
production behaviour (it pauses; nothing else is faked): the notice, Slurm, the script,
the agent and the workers are real.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from slurm_elastic.envvars import TEST_PAUSE_AT_ENV, TEST_PAUSE_DIR_ENV
from slurm_elastic.slurm.jobstate import JobState
from tests.conftest import SlurmCluster
from tests.faults.harness import FaultRun
from tests.helpers import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(600)]

PHASES = ("shell", "exec", "agent_start", "rendezvous", "workers_start")
#: Phases before the workers exist: nothing may have started training.
BEFORE_WORKERS = {"shell", "exec", "agent_start", "rendezvous"}


def notice_pending(pid: int, sig: signal.Signals = signal.SIGUSR2) -> bool:
    """Whether ``sig`` is pending (held, blocked) for process ``pid``."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    bit = 1 << (int(sig) - 1)
    return any(
        line.split(":")[0] in ("SigPnd", "ShdPnd") and int(line.split()[1], 16) & bit
        for line in status.splitlines()
    )


@pytest.mark.parametrize("phase", PHASES)
def test_a_notice_at_each_start_up_phase_requeues_the_task_and_loses_nothing(
    slurm_cluster: SlurmCluster, tmp_path: Path, phase: str
) -> None:
    pause = tmp_path / "pause"
    pause.mkdir()
    run = FaultRun(
        slurm_cluster,
        tmp_path / "run",
        steps=100,
        values={
            "nnodes": "1:1",
            "nproc_per_node": 1,
            "cpus_per_task": 1,
            "env": {TEST_PAUSE_AT_ENV: phase, TEST_PAUSE_DIR_ENV: str(pause)},
        },
    )
    try:
        run.submit()
        reached = pause / f"{phase}.reached"
        wait_for(reached.exists, 240, f"the task to pause at {phase}\n{run.logs()}", interval=0.1)
        pid = int(reached.read_text().split()[0])
        slurm_cluster.client.cancel(f"{run.job}_0", signal="USR2", batch=True)
        # Held (pending while blocked) or acted on (the agent's handler): not lost.
        wait_for(
            lambda: notice_pending(pid) or run.events(0, "agent.signal"),
            30,
            f"the notice at {phase} to be held or acted on (it was lost)\n{run.logs()}",
            interval=0.05,
        )
        (pause / f"{phase}.go").touch()
        requeued = wait_for(
            lambda: run.events(0, "agent.requeued"),
            120,
            f"the task to requeue itself after a notice at {phase}\n{run.logs()}",
            interval=0.2,
        )
        assert requeued[0]["requeue_count"] == 1, requeued  # from the first run
        first = [e for e in run.events(0, "agent.signal") if e["time"] <= requeued[0]["time"]]
        assert first and first[0]["signal"] == "SIGUSR2" and first[0]["notice"], first
        trained = [e for e in run.events(0, "train.start") if e["time"] <= requeued[0]["time"]]
        if phase in BEFORE_WORKERS:
            assert not trained, f"workers started despite a notice at {phase}: {trained}"
        infos = run.finish()
        assert [i.state for i in infos] == [JobState.COMPLETED], f"{infos}\n{run.logs()}"
        assert (infos[0].restarts or 0) >= 1, f"no requeue after a notice at {phase}"
        run.check_end(tmp_path)
    finally:
        run.cleanup()
