"""Exit codes of ``slurm-elastic agent``: what happened to this node's agent.

Slurm records the batch script's exit status, so these are visible in ``sacct`` /
``scontrol show job`` (``ExitCode=3:0``) and in the array task's state.

Torch-free (the lowest layer): the submission side (:mod:`slurm_elastic.submit`) reads
an agent's exit status with it without importing the agent.
"""

from __future__ import annotations

import enum

__all__ = ["RUN_OK", "ExitCode", "describe", "is_run_ok"]


class ExitCode(enum.IntEnum):
    """The agent's exit status."""

    #: Training finished (also: this node came back after the run had already finished).
    FINISHED = 0
    #: The workers kept failing and ``max_restarts`` was spent.
    FAILED = 1
    #: Bad arguments or configuration, or an unusable rendezvous directory (missing,
    #: read-only, unsafe); nothing was started.
    USAGE = 2
    #: Preemption or time-limit notice: checkpoint flushed, left the rendezvous, and this
    #: node's own job/array task was requeued.
    PREEMPTED_REQUEUED = 3
    #: Preemption notice handled, but not requeued (``requeue: never``, ``max_requeues``
    #: reached, not in Slurm, or the requeue call failed).
    PREEMPTED = 4
    #: SIGTERM/SIGINT with no notice first (``scancel``, a time limit without ``--signal``):
    #: workers stopped, left the rendezvous, not requeued.
    TERMINATED = 5
    #: The rendezvous could not be joined (join timeout, store error).
    RENDEZVOUS_FAILED = 6


#: Exit codes that are not a failure of the run: finished, or preempted and requeued
#: (the requeued task carries on).
RUN_OK: frozenset[ExitCode] = frozenset({ExitCode.FINISHED, ExitCode.PREEMPTED_REQUEUED})


def is_run_ok(code: int) -> bool:
    """Whether an agent exit status is not a failure of the run (see :data:`RUN_OK`)."""
    return code in RUN_OK


def describe(code: int) -> str:
    """The name of ``code`` (``"PREEMPTED"``), or ``"?"`` for a status that is not ours."""
    try:
        return ExitCode(code).name
    except ValueError:
        return "?"
