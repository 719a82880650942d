"""Fault matrix, two jobs sharing one rendezvous root:

* with **different run ids** (the default: each job's id): both complete, each exactly;
* with the **same run id** while the first runs: the second is refused with a clear
  message naming the run id, and the first completes undisturbed.

The second case is the rendezvous' same-run-id guard of issue #9 (``RunIdInUseError``:
the refused agent exits 2, ``USAGE``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_elastic.exit_codes import ExitCode
from slurm_elastic.slurm.jobstate import JobState
from tests.conftest import SlurmCluster
from tests.faults.harness import FaultRun
from tests.helpers import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

TERMINAL = {s for s in JobState if s.is_terminal}
ONE_TASK = {"nnodes": "1:1", "nproc_per_node": 1, "cpus_per_task": 1}


def _runs(
    cluster: SlurmCluster, tmp: Path, root: Path, names: list[str], **extra: str
) -> list[FaultRun]:
    return [
        FaultRun(
            cluster, tmp / name, steps=200, values={**ONE_TASK, "rdzv_endpoint": str(root), **extra}
        )
        for name in names
    ]


@pytest.fixture
def cleanup() -> Iterator[list[FaultRun]]:
    runs: list[FaultRun] = []
    yield runs
    for run in runs:
        run.cleanup()


def test_two_jobs_with_different_run_ids_share_a_root(
    slurm_cluster: SlurmCluster, tmp_path: Path, cleanup: list[FaultRun]
) -> None:
    runs = _runs(slurm_cluster, tmp_path, tmp_path / "rdzv", ["a", "b"])
    cleanup.extend(runs)
    for run in runs:
        run.submit()
    for run in runs:
        run.wait_training(1, 0, 240, f"job {run.job}")
    assert {p.name for p in (tmp_path / "rdzv").iterdir()} >= {runs[0].job, runs[1].job}
    for run in runs:
        infos = run.finish()
        assert {i.state for i in infos} == {JobState.COMPLETED}, f"{infos}\n{run.logs()}"
    for run in runs:
        run.check_end(tmp_path)


def test_a_second_job_with_the_same_run_id_is_refused_clearly(
    slurm_cluster: SlurmCluster, tmp_path: Path, cleanup: list[FaultRun]
) -> None:
    first, second = _runs(
        slurm_cluster, tmp_path, tmp_path / "rdzv", ["first", "second"], run_id="shared-id"
    )
    cleanup.extend([first, second])
    first.submit()
    first.wait_training(1, 0, 240, "the first job")
    t0 = time.time()
    second.submit()
    info = slurm_cluster.wait_state(f"{second.job}_0", TERMINAL, timeout=240)
    log = second.logs()
    # refused at once as a usage error (the fix is another run id), not a crash
    codes = {int(ExitCode.USAGE), int(ExitCode.RENDEZVOUS_FAILED)}
    assert int(info.exit_code.split(":")[0]) in codes, f"{info}\n{log}"
    assert "in use by another live job" in log, log
    assert "shared-id" in log and "run id" in log.lower(), log
    # the first job never saw the second one: no new round after it came
    wait_for(lambda: first.step_now() > 20, 60, "the first job to go on")
    new_round = ("agent.workers_started", "agent.reformed_in_place")
    rounds = [e for e in first.events(t0) if e["kind"] in new_round]
    assert not rounds, f"the first job was disturbed: {rounds}"
    infos = first.finish()
    assert {i.state for i in infos} == {JobState.COMPLETED}, f"{infos}\n{first.logs()}"
    first.check_end(tmp_path)
