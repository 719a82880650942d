"""SlurmJob: state from our Slurm seam (recorded real output), wait with a deadline, cancel.

Slurm is faked at the subprocess seam only: the real ``SlurmClient`` runs with a runner that
replays output recorded on the local Slurm cluster (tests/data/slurm/), here a cluster
without slurmdbd, where submitit's own state is UNKNOWN forever.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.slurm.commands import SlurmClient
from slurm_elastic.submit import JobFailedError, JobState, JobTimeoutError, SlurmJob
from slurm_elastic.submit.job import summarize

DATA = Path(__file__).resolve().parent.parent / "data" / "slurm"
ARRAY = (DATA / "scontrol_show_job_array.txt").read_text()  # job 9, tasks 0-3 RUNNING
SACCT_DISABLED = (DATA / "sacct_disabled_stderr.txt").read_text()


class Replay:
    """A runner answering sacct (disabled) and scontrol show job from recorded text."""

    def __init__(self, show_job: str) -> None:
        self.show_job = show_job
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str], **_: Any) -> subprocess.CompletedProcess[str]:
        argv = list(argv)
        self.calls.append(argv)
        if argv[0] == "sacct":
            return subprocess.CompletedProcess(argv, 1, "", SACCT_DISABLED)
        if argv[:3] == ["scontrol", "show", "job"]:
            if not self.show_job:
                return subprocess.CompletedProcess(
                    argv, 1, "", "slurm_load_jobs error: Invalid job id specified\n"
                )
            return subprocess.CompletedProcess(argv, 0, self.show_job, "")
        if argv[0] == "scancel":
            return subprocess.CompletedProcess(argv, 0, "", "")
        raise AssertionError(f"unexpected command {argv}")


def _task_state(text: str, task: int, state: str) -> str:
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if f" ArrayTaskId={task} " in line:
            lines[i] = line.replace("JobState=RUNNING", f"JobState={state}")
    return "".join(lines)


def _job(runner: Replay) -> SlurmJob:
    refs = [f"9_{i}" for i in range(4)]
    return SlurmJob("9", refs, SlurmClient(runner=runner), sbatch_text="")


def test_running_array_is_running() -> None:
    job = _job(Replay(ARRAY))
    assert job.task_states() == [JobState.RUNNING] * 4
    assert job.state() == JobState.RUNNING
    assert not job.done()


def test_elastic_array_finished_with_cancelled_leftovers_is_completed() -> None:
    text = ARRAY
    for task, state in ((0, "COMPLETED"), (1, "COMPLETED"), (2, "CANCELLED"), (3, "CANCELLED")):
        text = _task_state(text, task, state)
    job = _job(Replay(text))
    assert job.wait(timeout_s=5, poll_s=0.01) == JobState.COMPLETED


def test_failed_task_makes_the_job_failed_and_requeued_is_pending() -> None:
    text = _task_state(_task_state(ARRAY, 0, "FAILED"), 1, "COMPLETED")
    for task in (2, 3):
        text = _task_state(text, task, "COMPLETED")
    assert _job(Replay(text)).state() == JobState.FAILED
    requeued = _task_state(ARRAY, 2, "REQUEUED")
    assert _job(Replay(requeued)).task_states()[2] == JobState.PENDING


def test_result_returns_completed_or_raises_naming_the_state_and_the_logs() -> None:
    done = ARRAY
    for task in range(4):
        done = _task_state(done, task, "COMPLETED" if task < 2 else "CANCELLED")
    assert _job(Replay(done)).result(timeout_s=5, poll_s=0.01) == JobState.COMPLETED
    failed = ARRAY
    for task in range(4):
        failed = _task_state(failed, task, "FAILED" if task == 1 else "COMPLETED")
    job = SlurmJob("9", [f"9_{i}" for i in range(4)], SlurmClient(runner=Replay(failed)), "",
                   logs=[Path("/shared/logs/slurm-elastic-9_1.out")])  # fmt: skip
    with pytest.raises(JobFailedError, match=r"job 9 ended FAILED.*slurm-elastic-9_1\.out"):
        job.result(timeout_s=5, poll_s=0.01)


def test_wait_has_a_deadline_for_a_job_that_never_ends() -> None:
    job = _job(Replay(ARRAY))
    started = time.monotonic()
    with pytest.raises(JobTimeoutError, match=r"job 9 is still RUNNING after 0.3 s"):
        job.wait(timeout_s=0.3, poll_s=0.05)
    assert time.monotonic() - started < 5


def test_forgotten_job_without_result_is_unknown_not_finished() -> None:
    job = _job(Replay(""))  # purged from slurmctld, no sacct
    assert job.state() == JobState.UNKNOWN
    assert not job.done()


def test_cancel_goes_through_the_seam() -> None:
    runner = Replay(ARRAY)
    _job(runner).cancel()
    assert ["scancel", "9"] in runner.calls


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ([JobState.PENDING, JobState.COMPLETED], JobState.PENDING),
        ([JobState.RUNNING, JobState.PENDING], JobState.RUNNING),
        ([JobState.CANCELLED, JobState.CANCELLED], JobState.CANCELLED),
        ([JobState.COMPLETED, JobState.FAILED], JobState.FAILED),
        ([JobState.COMPLETED, JobState.UNKNOWN], JobState.UNKNOWN),
        ([], JobState.UNKNOWN),
    ],
)
def test_summarize(states: list[JobState], expected: JobState) -> None:
    assert summarize(states) == expected


def test_the_handle_prints_as_its_job_and_cluster_without_asking_slurm() -> None:
    runner = Replay(ARRAY)
    job = _job(runner)
    assert repr(job) == "SlurmJob(job_id='9', cluster='slurm')"
    assert str(job) == repr(job)
    assert runner.calls == []  # printing a handle queries nothing
