"""``slurm-elastic status`` says what a task's failing agent status means, and where the
agent wrote why.

Seen as a new user: a job whose agents refused to start (its id repeated an earlier
run's) showed that earlier run's nodes and steps and ``FAILED  NonZeroExitCode``, nothing
more; the reason was only in the task's Slurm output. Slurm's task records are the
SlurmClient seam's (as ``scontrol show job`` gives them; real Slurm: the new-user check
of the session that added this, on the local cluster).
"""

from __future__ import annotations

from slurm_elastic.cli.status import render_table
from slurm_elastic.cli.summary import SlurmTask, summarize_run


def _status(*tasks: SlurmTask) -> str:
    summary = summarize_run("77", "/nonexistent/events", [], slurm_job="77", slurm_tasks=tasks)
    return render_table(summary)


def test_a_task_whose_agent_refused_to_start_says_so_and_where_the_reason_is() -> None:
    out = _status(
        SlurmTask("77_0", "FAILED", "node1", 1, "NonZeroExitCode", "2:0"),
        SlurmTask("77_1", "FAILED", "node2", 0, "NonZeroExitCode", "1:0"),
        SlurmTask("77_2", "FAILED", "node3", 0, "NonZeroExitCode", "6:0"),
    )
    assert (
        "task 77_0: agent exit 2 (USAGE): it refused to start (configuration, or the run's "
        "directories or owner: nothing was started); the reason is the ERROR line of the "
        "task's Slurm output (scontrol show job 77_0: StdOut)"
    ) in out
    assert "task 77_1: agent exit 1 (FAILED): its workers kept failing" in out
    assert "task 77_2: agent exit 6 (RENDEZVOUS_FAILED): it could not join" in out


def test_tasks_that_did_not_fail_by_an_agent_status_get_no_hint() -> None:
    out = _status(
        SlurmTask("77_0", "COMPLETED", "node1", 0, None, "0:0"),
        SlurmTask("77_1", "FAILED", "node2", 0, "NonZeroExitCode", "137:0"),  # not ours
        SlurmTask("77_2", "PENDING", "", 1, "BeginTime", "3:0"),  # preempted, requeued
        SlurmTask("77_3", "FAILED", "node4", 0, "NonZeroExitCode", ""),  # no exit code
    )
    assert "agent exit" not in out
