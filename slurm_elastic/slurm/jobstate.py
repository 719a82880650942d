"""Slurm job states as one enum, and the job record the Slurm seam returns.

Slurm spells a job's state differently depending on who you ask (``squeue %T``,
``scontrol show job``'s ``JobState=``, ``sacct``'s ``State`` with suffixes such as
``CANCELLED by 0``). :data:`STATE_TABLE` is the one explicit table from those strings to
:class:`JobState`; :func:`job_state_from_slurm` applies it. Unknown strings map to
:attr:`JobState.UNKNOWN` instead of failing: a newer Slurm may add states.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["STATE_TABLE", "JobInfo", "JobState", "job_state_from_slurm"]


class JobState(enum.Enum):
    """The state of one Slurm job (or one array task)."""

    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    SUSPENDED = "SUSPENDED"
    STOPPED = "STOPPED"
    SIGNALING = "SIGNALING"
    STAGE_OUT = "STAGE_OUT"
    RESIZING = "RESIZING"
    REQUEUED = "REQUEUED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    REQUEUE_FED = "REQUEUE_FED"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    RESV_DEL_HOLD = "RESV_DEL_HOLD"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    PREEMPTED = "PREEMPTED"
    REVOKED = "REVOKED"
    UNKNOWN = "UNKNOWN"

    @property
    def is_terminal(self) -> bool:
        """True when the job has ended and Slurm will not run it again by itself.

        ``PREEMPTED`` is terminal: with ``PreemptMode=REQUEUE`` a preempted job shows
        ``REQUEUED``/``PENDING`` instead, so a job still reported ``PREEMPTED`` was
        cancelled by its preemption. ``REQUEUE_HOLD``/``SPECIAL_EXIT`` are held, not
        ended (``scontrol release`` runs them again).
        """
        return self in _TERMINAL

    @property
    def is_active(self) -> bool:
        """True while the job holds (or is about to hold) nodes: it may run code now."""
        return self in _ACTIVE


_TERMINAL = frozenset(
    {
        JobState.COMPLETED,
        JobState.FAILED,
        JobState.CANCELLED,
        JobState.TIMEOUT,
        JobState.NODE_FAIL,
        JobState.OUT_OF_MEMORY,
        JobState.BOOT_FAIL,
        JobState.DEADLINE,
        JobState.PREEMPTED,
        JobState.REVOKED,
    }
)
_ACTIVE = frozenset(
    {
        JobState.CONFIGURING,
        JobState.RUNNING,
        JobState.COMPLETING,
        JobState.SIGNALING,
        JobState.STAGE_OUT,
        JobState.RESIZING,
    }
)

#: Every spelling Slurm uses (long names and squeue's compact codes) -> JobState.
STATE_TABLE: dict[str, JobState] = {
    "PENDING": JobState.PENDING,
    "PD": JobState.PENDING,
    "CONFIGURING": JobState.CONFIGURING,
    "CF": JobState.CONFIGURING,
    "RUNNING": JobState.RUNNING,
    "R": JobState.RUNNING,
    "COMPLETING": JobState.COMPLETING,
    "CG": JobState.COMPLETING,
    "SUSPENDED": JobState.SUSPENDED,
    "S": JobState.SUSPENDED,
    "STOPPED": JobState.STOPPED,
    "ST": JobState.STOPPED,
    "SIGNALING": JobState.SIGNALING,
    "SI": JobState.SIGNALING,
    "STAGE_OUT": JobState.STAGE_OUT,
    "SO": JobState.STAGE_OUT,
    "RESIZING": JobState.RESIZING,
    "RS": JobState.RESIZING,
    "REQUEUED": JobState.REQUEUED,
    "RQ": JobState.REQUEUED,
    "REQUEUE_HOLD": JobState.REQUEUE_HOLD,
    "RH": JobState.REQUEUE_HOLD,
    "REQUEUE_FED": JobState.REQUEUE_FED,
    "RF": JobState.REQUEUE_FED,
    "SPECIAL_EXIT": JobState.SPECIAL_EXIT,
    "SE": JobState.SPECIAL_EXIT,
    "RESV_DEL_HOLD": JobState.RESV_DEL_HOLD,
    "RD": JobState.RESV_DEL_HOLD,
    "COMPLETED": JobState.COMPLETED,
    "CD": JobState.COMPLETED,
    "FAILED": JobState.FAILED,
    "F": JobState.FAILED,
    "CANCELLED": JobState.CANCELLED,
    "CA": JobState.CANCELLED,
    "TIMEOUT": JobState.TIMEOUT,
    "TO": JobState.TIMEOUT,
    "NODE_FAIL": JobState.NODE_FAIL,
    "NF": JobState.NODE_FAIL,
    "OUT_OF_MEMORY": JobState.OUT_OF_MEMORY,
    "OOM": JobState.OUT_OF_MEMORY,
    "BOOT_FAIL": JobState.BOOT_FAIL,
    "BF": JobState.BOOT_FAIL,
    "DEADLINE": JobState.DEADLINE,
    "DL": JobState.DEADLINE,
    "PREEMPTED": JobState.PREEMPTED,
    "PR": JobState.PREEMPTED,
    "REVOKED": JobState.REVOKED,
    "RV": JobState.REVOKED,
}


def job_state_from_slurm(text: str) -> JobState:
    """Map a Slurm state string to :class:`JobState`.

    Accepts ``sacct`` decorations (``CANCELLED by 0``, ``CANCELLED+``) and
    ``scontrol`` flags joined with ``+`` (``RUNNING+COMPLETING``: the first word wins).

    Args:
        text: the state as printed by squeue, scontrol or sacct.

    Returns:
        The state, or :attr:`JobState.UNKNOWN` for a string not in :data:`STATE_TABLE`.
    """
    word = text.strip().split(" ", 1)[0].split("+", 1)[0].upper()
    return STATE_TABLE.get(word, JobState.UNKNOWN)


@dataclass(frozen=True)
class JobInfo:
    """What Slurm reports about one job or one array task.

    Attributes:
        job_id: Slurm's own id of this job (for an array task: the task's own id,
            e.g. ``"7"`` for task ``1_2``).
        state: the job state.
        array_job_id: the array's job id, or ``None`` when not an array task.
        array_task_id: the task index, or ``None`` when not an array task (or when the
            record stands for several pending tasks, e.g. ``1_[3-9]``).
        reason: Slurm's reason (``None``, ``BeginTime``, ``Resources``, ...), if given.
        restarts: how often the job was requeued, ``None`` when the source does not say.
        node_list: the nodes it runs on / ran on (a hostlist), ``""`` when none.
        partition: the partition, ``""`` when unknown.
        exit_code: ``"code:signal"`` as Slurm prints it, ``""`` when unknown.
        source: which command gave this record (``sacct``, ``scontrol``, ``squeue``).
    """

    job_id: str
    state: JobState
    array_job_id: str | None = None
    array_task_id: str | None = None
    reason: str | None = None
    restarts: int | None = None
    node_list: str = ""
    partition: str = ""
    exit_code: str = ""
    source: str = ""

    @property
    def ref(self) -> str:
        """The reference to pass to scontrol/scancel for exactly this job or task."""
        if self.array_job_id is not None and self.array_task_id is not None:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id
