"""Handles of submitted jobs: state, wait with a deadline, cancel, log paths.

One :class:`JobState` enum for both clusters; Slurm's state names map to it through one
table (:data:`SLURM_STATES`). A job made of several tasks (array tasks, local nodes) is
summarised by :func:`summarize`: it is finished when no task is pending or running, and
it COMPLETED when some task completed and none failed - in an elastic run the first agent
to finish cancels the tasks still queued, so CANCELLED tasks beside COMPLETED ones are
normal.
"""

from __future__ import annotations

import abc
import enum
import logging
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from slurm_elastic.errors import JobFailedError, JobTimeoutError, SlurmError
from slurm_elastic.exit_codes import is_run_ok
from slurm_elastic.slurm.control import SlurmControl
from slurm_elastic.slurm.jobstate import JobInfo
from slurm_elastic.slurm.jobstate import JobState as SlurmState
from slurm_elastic.submit import processes

__all__ = [
    "SLURM_STATES",
    "JobFailedError",
    "JobHandle",
    "JobState",
    "JobTimeoutError",
    "LocalJob",
    "SlurmJob",
    "summarize",
]

log = logging.getLogger(__name__)


class JobState(str, enum.Enum):
    """The state of a job or of one of its tasks."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    UNKNOWN = "UNKNOWN"

    @property
    def finished(self) -> bool:
        """Whether this state is final."""
        return self in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED)


#: Slurm's job state (the seam's enum) -> the state of a task of our job.
SLURM_STATES: dict[SlurmState, JobState] = {
    SlurmState.PENDING: JobState.PENDING,
    SlurmState.REQUEUED: JobState.PENDING,
    SlurmState.REQUEUE_HOLD: JobState.PENDING,
    SlurmState.REQUEUE_FED: JobState.PENDING,
    SlurmState.RESV_DEL_HOLD: JobState.PENDING,
    SlurmState.SPECIAL_EXIT: JobState.PENDING,
    SlurmState.CONFIGURING: JobState.RUNNING,
    SlurmState.RUNNING: JobState.RUNNING,
    SlurmState.COMPLETING: JobState.RUNNING,
    SlurmState.SUSPENDED: JobState.RUNNING,
    SlurmState.STOPPED: JobState.RUNNING,
    SlurmState.SIGNALING: JobState.RUNNING,
    SlurmState.STAGE_OUT: JobState.RUNNING,
    SlurmState.RESIZING: JobState.RUNNING,
    SlurmState.COMPLETED: JobState.COMPLETED,
    SlurmState.FAILED: JobState.FAILED,
    SlurmState.TIMEOUT: JobState.FAILED,
    SlurmState.NODE_FAIL: JobState.FAILED,
    SlurmState.OUT_OF_MEMORY: JobState.FAILED,
    SlurmState.BOOT_FAIL: JobState.FAILED,
    SlurmState.DEADLINE: JobState.FAILED,
    SlurmState.CANCELLED: JobState.CANCELLED,
    SlurmState.PREEMPTED: JobState.CANCELLED,
    SlurmState.REVOKED: JobState.CANCELLED,
    SlurmState.UNKNOWN: JobState.UNKNOWN,
}


def summarize(states: Sequence[JobState]) -> JobState:
    """The state of a job from the states of its tasks (see the module docstring)."""
    if not states:
        return JobState.UNKNOWN
    if JobState.RUNNING in states:
        return JobState.RUNNING
    if JobState.PENDING in states:
        return JobState.PENDING
    if JobState.UNKNOWN in states:
        return JobState.UNKNOWN
    if JobState.FAILED in states:
        return JobState.FAILED
    if JobState.COMPLETED in states:
        return JobState.COMPLETED
    return JobState.CANCELLED


class JobHandle(abc.ABC):
    """A submitted job: ``state()``, ``wait()``, ``result()``, ``cancel()``, ``log_paths()``
    (submitit's job conventions; the state comes from our own Slurm seam)."""

    #: the job's id (the run id for local jobs)
    job_id: str
    #: ``"local"`` or ``"slurm"``
    cluster: str

    def __repr__(self) -> str:
        # What a user printing the handle wants: which job, where (no state query here).
        return f"{type(self).__name__}(job_id={self.job_id!r}, cluster={self.cluster!r})"

    @abc.abstractmethod
    def task_states(self) -> list[JobState]:
        """The state of each task (array task, node process) of the job."""

    def state(self) -> JobState:
        """The job's state, summarised over its tasks."""
        return summarize(self.task_states())

    def done(self) -> bool:
        """Whether the job has finished (in any way)."""
        return self.state().finished

    def wait(
        self,
        timeout_s: float | None = None,
        poll_s: float = 0.5,
        on_poll: Callable[[str, str], None] | None = None,
    ) -> JobState:
        """Wait until the job is finished; return its final state.

        ``on_poll(job_id, state)`` is called at each poll (``submit --wait`` progress).

        Raises:
            JobTimeoutError: still not finished after ``timeout_s`` seconds (the job is
                left running; cancel it if you want it gone).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            state = self.state()
            if on_poll is not None:
                on_poll(self.job_id, state.value)
            if state.finished:
                return state
            if deadline is not None and time.monotonic() >= deadline:
                raise JobTimeoutError(
                    f"job {self.job_id} is still {state.value} after {timeout_s:g} s; "
                    "wait longer or cancel it"
                )
            time.sleep(poll_s)

    def result(self, timeout_s: float | None = None, poll_s: float = 0.5) -> JobState:
        """Wait for the job; return ``COMPLETED`` or raise (as submitit's ``job.result()``).

        Raises:
            JobFailedError: the job finished FAILED, CANCELLED or UNKNOWN; the message
                names the state and the log files to read.
            JobTimeoutError: see :meth:`wait`.
        """
        state = self.wait(timeout_s, poll_s)
        if state != JobState.COMPLETED:
            logs = ", ".join(str(p) for p in self.log_paths()) or "none"
            raise JobFailedError(
                f"job {self.job_id} ended {state.value}, not COMPLETED; read its logs: {logs}"
            )
        return state

    @abc.abstractmethod
    def cancel(self) -> None:
        """Stop the job; no process of it survives this call (local) / it leaves the queue."""

    @abc.abstractmethod
    def log_paths(self) -> list[Path]:
        """The files holding the job's output."""

    def __enter__(self) -> JobHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.done():
            self.cancel()


class LocalJob(JobHandle):
    """N node-agent processes on this machine (``cluster="local"``).

    Attributes:
        run_id: the run id shared by the local agents.
        folder: the job's directory (spec, logs, default state and rendezvous dirs).
    """

    cluster = "local"

    def __init__(
        self,
        run_id: str,
        folder: Path,
        procs: Sequence[subprocess.Popen[bytes]],
        logs: Sequence[Path],
        grace_s: float,
    ) -> None:
        self.job_id = run_id
        self.run_id = run_id
        self.folder = folder
        self._procs = list(procs)
        self._logs = list(logs)
        self._grace_s = grace_s
        self._cancelled = False

    @property
    def pids(self) -> list[int]:
        """The agents' process ids."""
        return [p.pid for p in self._procs]

    def exit_codes(self) -> list[int | None]:
        """Each agent's exit status (``None`` while running; negative: killed by signal)."""
        return [p.poll() for p in self._procs]

    def task_states(self) -> list[JobState]:
        out = []
        for code in self.exit_codes():
            if code is None:
                out.append(JobState.RUNNING)
            elif self._cancelled:
                out.append(JobState.CANCELLED)
            else:
                # finished, or preempted and requeued: not a failure of the run
                out.append(JobState.COMPLETED if is_run_ok(code) else JobState.FAILED)
        return out

    def cancel(self, grace_s: float | None = None) -> None:
        """SIGTERM the agents (they stop their workers), SIGKILL what is left after
        ``grace_s`` (default: the config's ``shutdown_timeout_s`` + 10 s), reap them all.
        """
        if all(code is not None for code in self.exit_codes()):
            # still sweep: an agent killed from outside may have orphaned workers
            processes.stop_tree(self._procs, 0)
            return
        self._cancelled = True
        left = processes.stop_tree(self._procs, self._grace_s if grace_s is None else grace_s)
        if left:
            log.warning("local job %s: processes %s survived SIGKILL", self.job_id, sorted(left))

    def log_paths(self) -> list[Path]:
        return list(self._logs)


class SlurmJob(JobHandle):
    """A job submitted to Slurm (an array, or one multi-node job).

    Its state comes from our Slurm seam (``client.job_infos``: ``scontrol``, then
    ``sacct`` where the site keeps accounting). A job Slurm no longer remembers
    (``MinJobAge`` passed) on a cluster without accounting reads ``UNKNOWN``, never a
    guess.

    Attributes:
        task_refs: ``<job>_<task>`` for each array task, else ``[<job>]``.
        sbatch_text: the script that was sent (the dry run's text).
    """

    cluster = "slurm"

    def __init__(
        self,
        job_id: str,
        task_refs: Sequence[str],
        client: SlurmControl,
        sbatch_text: str,
        logs: Sequence[Path] = (),
    ) -> None:
        self.job_id = job_id
        self.task_refs = list(task_refs)
        self.sbatch_text = sbatch_text
        self._client = client
        self._logs = list(logs)

    def task_states(self) -> list[JobState]:
        try:
            infos: list[JobInfo] = list(self._client.job_infos(self.job_id))
        except SlurmError as exc:
            # not found (purged after MinJobAge, no sacct) or Slurm unreachable right now
            log.debug("state of %s unavailable: %s", self.job_id, exc)
            infos = []
        by_ref = {info.ref: SLURM_STATES.get(info.state, JobState.UNKNOWN) for info in infos}
        # squeue-style records for several pending tasks (``12_[3-9]``) carry no task id
        pending_rest = any(
            info.array_task_id is None and SLURM_STATES.get(info.state) == JobState.PENDING
            for info in infos
        )
        out = []
        for ref in self.task_refs:
            if ref in by_ref:
                out.append(by_ref[ref])
            elif pending_rest:
                out.append(JobState.PENDING)
            else:
                out.append(JobState.UNKNOWN)
        return out

    def cancel(self) -> None:
        self._client.cancel(self.job_id)

    def log_paths(self) -> list[Path]:
        return list(self._logs)
