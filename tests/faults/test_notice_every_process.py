"""The notice as users' jobs really receive it (issue #22 item 8), on the real Slurm.

A notice that is not batch-only reaches *every process of the job's steps*: the agent,
its training workers and their forked ``DataLoader`` workers, all at once. Two forms:

* ``scancel``: ``scancel --signal=USR2 JOB`` without ``--batch`` (the steps only, not
  the batch shell);
* ``time_limit``: a job file with ``#SBATCH --signal=USR2@60`` and ``--time=3`` (no
  ``B:``: Slurm's own timer signals the steps' processes), as users write it: the
  rendered template with its ``B:`` removed. (``sbatch --signal=USR2@60`` on the command
  line does not do it: Slurm 22.05 keeps the script's ``B:`` flag, the batch shell got
  the notice and forwarded it.)

``fault_tolerant`` starts the agent as an ``srun`` step, so both forms reach it. (``elastic_array`` has no step: the agent *is* the batch shell, and a notice
without ``--batch``/``B:`` reaches no process at all; its template asks for ``B:``.)

The job runs ``examples/train_own_loop.py`` with ``DataLoader(num_workers=2)``. Each case
asserts: the notice reached the step, not the batch shell (no forwarding logged); every
loader worker caught or ignored the signal (none could die of it; none did: no
``DataLoader worker ... killed``/``exited unexpectedly`` in the log); the workers
checkpointed at their next step boundary (``train.preempted``) and that checkpoint
verifies; the agent requeued the job; the requeued run resumed from it and completed,
every sample once per epoch, the final step's checkpoint verifying and the parameters of
an uninterrupted run (the harness' end checks).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from slurm_elastic.checkpoint import CheckpointManager
from slurm_elastic.slurm.jobstate import JobState
from tests.conftest import SlurmCluster
from tests.faults.harness import FaultRun
from tests.helpers import process_tree, survives_signal, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

LOADER_DEATH = ("killed by signal", "exited unexpectedly")
FORMS = {
    # form: (steps, template values)
    "scancel": (300, {}),
    "time_limit": (1500, {"time": "3", "signal_lead_s": 60}),
}


def loader_workers(run: FaultRun) -> dict[int, list[int]]:
    """Each training worker of the run -> its child processes (its loader's workers)."""
    workers = [w for w in run.workers() if not w.cmdline.startswith("srun ")]  # srun's own
    return {w.pid: [p for p in process_tree(w.pid) if p != w.pid] for w in workers}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_notice_to_every_process_of_the_step_checkpoints_and_requeues(
    slurm_cluster: SlurmCluster, tmp_path: Path, form: str
) -> None:
    steps, values = FORMS[form]
    run = FaultRun(
        slurm_cluster,
        tmp_path / "run",
        mode="fault_tolerant",
        steps=steps,
        values={"nodes": 1, "nproc_per_node": 1, "cpus_per_task": 2, **values},
        train_module="train_own_loop",
        train_extra=["--num-workers", "2"],
    )
    try:
        script = run.script()
        if form == "time_limit":  # the user's own job file: the steps' processes
            script = script.replace("--signal=B:USR2@60", "--signal=USR2@60")
            assert "#SBATCH --signal=USR2@60\n" in script, script
        run.job = slurm_cluster.client.submit(script)
        found = wait_for(
            lambda: (
                run.step_now() >= 3
                and (w := loader_workers(run))
                and all(len(v) == 2 for v in w.values())
                and w
            ),
            240,
            f"the worker training with two DataLoader workers\n{run.logs()}",
            interval=0.2,
        )
        loaders = [p for v in found.values() for p in v]
        exposed = [p for p in loaders if survives_signal(p, signal.SIGUSR2) is False]
        at_notice = run.step_now()
        if form == "scancel":
            assert not run.events(0, "agent.signal"), "a notice before the test sent one"
            slurm_cluster.client.cancel(run.job, signal="USR2")  # the steps, not --batch
        requeued = wait_for(
            lambda: run.events(0, "agent.requeued"),
            240,
            f"the job to requeue itself after the notice\n{run.logs()}",
            interval=0.5,
        )
        first = [e for e in run.events(0, "agent.signal") if e["time"] <= requeued[0]["time"]]
        assert first and first[0]["signal"] == "SIGUSR2" and first[0]["notice"], first
        logs = run.logs()
        died = [line for line in logs.splitlines() if any(d in line for d in LOADER_DEATH)]
        assert not died, f"a DataLoader worker died of the notice: {died}\n{logs}"
        assert not exposed, f"DataLoader workers {exposed} could die of SIGUSR2"
        # the notice came to the step's processes, not through the batch shell's trap
        assert "forwarding to the agents" not in logs, logs
        # the workers checkpointed on it, at or after the step trained when it came
        saved = [e for e in run.events(0, "train.preempted") if e["time"] <= requeued[0]["time"]]
        assert saved and saved[0]["step"] >= at_notice, (saved, at_notice)
        CheckpointManager(run.checkpoint_dir).store.verify(saved[0]["step"], deep=True)
        resumed = wait_for(
            lambda: [e for e in run.events(requeued[0]["time"], "train.start") if e["step"] > 0],
            240,
            f"the requeued job to resume from its checkpoint\n{run.logs()}",
            interval=0.5,
        )
        assert resumed[0]["step"] == saved[0]["step"], (resumed, saved)
        infos = run.finish()
        assert [i.state for i in infos] == [JobState.COMPLETED], f"{infos}\n{run.logs()}"
        assert (infos[0].restarts or 0) >= 1, f"no requeue after the notice\n{run.logs()}"
        run.check_end(tmp_path)
    finally:
        run.cleanup()
