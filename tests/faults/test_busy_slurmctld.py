"""The agent's requeue of its own task while slurmctld does not answer.

On a busy cluster the controller answers late, exactly when preemptions come. Measured on
Slurm 22.05 (the local cluster): with slurmctld stopped past ``MessageTimeout``,
``scontrol requeue`` exits 1 with "Unexpected message received" after 10 s, and the
controller carries the requeue out when it goes on. The agent tries again
(:func:`slurm_elastic.agent.requeue.requeue_own`); a task found pending by a later try was
requeued by the earlier one.

The real-Slurm test stops the local cluster's slurmctld (SIGSTOP) until the agent's first
try has failed (after ``MessageTimeout``), and always resumes it.
The recorded-answer tests cover the answers the controller cannot be made to give here.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.agent.requeue import REQUEUE_RETRY_S, requeue_own
from slurm_elastic.config import ElasticConfig
from slurm_elastic.errors import SlurmError
from slurm_elastic.slurm.commands import SlurmClient
from slurm_elastic.slurm.env import SlurmEnv
from slurm_elastic.slurm.jobstate import JobState
from tests.conftest import SlurmCluster
from tests.helpers import wait_for

UNEXPECTED = "Unexpected message received for job 7\n"  # as measured (module docstring)
PENDING = "Job is pending execution for job 7\n"
OWN_TASK = {"SLURM_JOB_ID": "7"}


class Answers:
    """A runner that gives ``scontrol requeue`` the recorded answers in turn."""

    def __init__(self, *stderr: str) -> None:
        self.stderr = list(stderr)
        self.calls = 0

    def __call__(self, argv: Sequence[str], **_: Any) -> subprocess.CompletedProcess[str]:
        assert list(argv[:2]) == ["scontrol", "requeue"], argv
        self.calls += 1
        err = self.stderr.pop(0)
        return subprocess.CompletedProcess(list(argv), 1 if err else 0, "", err)


def _requeue(answers: Answers, pauses: list[float]) -> bool | SlurmError:
    return requeue_own(
        ElasticConfig(),
        SlurmEnv.from_environ(OWN_TASK),
        SlurmClient(runner=answers),
        sleep=pauses.append,
    )


def test_a_requeue_that_failed_transiently_is_tried_again() -> None:
    answers, pauses = Answers(UNEXPECTED, UNEXPECTED, ""), []
    assert _requeue(answers, pauses) is True
    assert answers.calls == 3 and pauses == [1.0, 2.0]


def test_a_task_found_pending_after_a_failed_try_was_requeued_by_it() -> None:
    answers, pauses = Answers(UNEXPECTED, PENDING), []
    assert _requeue(answers, pauses) is True
    assert answers.calls == 2


def test_a_pending_task_at_the_first_try_is_left_to_the_caller() -> None:
    # Slurm's own preemption requeue got there first: not ours to report as done
    answers, pauses = Answers(PENDING), []
    outcome = _requeue(answers, pauses)
    assert isinstance(outcome, SlurmError) and "pending" in str(outcome)
    assert answers.calls == 1 and pauses == []


def test_a_refusal_is_not_tried_again() -> None:
    answers, pauses = Answers("Requested operation is presently disabled for job 7\n"), []
    assert isinstance(_requeue(answers, pauses), SlurmError)
    assert answers.calls == 1


def test_the_tries_stop_within_the_retry_window() -> None:
    answers, pauses = Answers(*[UNEXPECTED] * 10), []
    outcome = _requeue(answers, pauses)
    assert isinstance(outcome, SlurmError) and "Unexpected message" in str(outcome)
    assert answers.calls == 5 and sum(pauses) <= REQUEUE_RETRY_S


def _slurmctld_pid(cluster: SlurmCluster) -> int:
    pid_file = Path(cluster.env["SLURM_CONF"]).parent / "run" / "slurmctld.pid"
    return int(pid_file.read_text().split()[0])


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_a_requeue_during_a_slurmctld_outage_requeues_the_task_once(
    slurm_cluster: SlurmCluster, caplog: pytest.LogCaptureFixture
) -> None:
    if slurm_cluster.mode == "external":
        why = "stops the controller: only on the local cluster of scripts/slurm-cluster"
        pytest.skip(reason=why)
    cl = slurm_cluster.client
    job = cl.submit("#!/bin/bash\n#SBATCH --requeue\n#SBATCH --output=/dev/null\nsleep 600\n")
    try:
        slurm_cluster.wait_state(job, {JobState.RUNNING}, 60)
        env = SlurmEnv.from_environ({"SLURM_JOB_ID": job})
        timeout = int(cl.site_config().get("MessageTimeout", "10 sec").split()[0])
        outcome: list[bool | SlurmError] = []
        pid = _slurmctld_pid(slurm_cluster)
        caplog.set_level(logging.INFO, logger="slurm_elastic.agent.requeue")
        os.kill(pid, signal.SIGSTOP)
        try:
            agent = threading.Thread(
                target=lambda: outcome.append(requeue_own(ElasticConfig(), env, cl)), daemon=True
            )
            agent.start()
            # the outage lasts until the first try failed (after MessageTimeout)
            wait_for(
                lambda: "trying again" in caplog.text,
                timeout + 30,
                "the first requeue to fail while slurmctld is stopped",
                interval=0.2,
            )
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: outcome, REQUEUE_RETRY_S + 60, "the requeue to end", interval=0.2)
        assert outcome == [True], caplog.text
        info = cl.job_info(job)
        assert info.restarts == 1, f"requeued {info.restarts} times, not once: {info}"
    finally:
        cl.cancel(job)
