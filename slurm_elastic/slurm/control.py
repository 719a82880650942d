"""``SlurmControl``: the one seam through which slurm_elastic acts on Slurm jobs.

A small Protocol with documented behaviour (the shape of torch's ``RendezvousBackend``):
everything the agent (requeue its own task, cancel the array's pending tasks), the
submission (is Slurm reachable?) and job handles (task states, cancel) need. The real
implementation is :class:`slurm_elastic.slurm.commands.SlurmClient` (``sbatch``,
``scontrol``, ``scancel``, ``sacct`` behind one subprocess seam); tests replay recorded
output through its ``runner`` instead of faking this Protocol.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from slurm_elastic.slurm.jobstate import JobInfo, JobState

__all__ = ["SlurmControl", "default_control"]


@runtime_checkable
class SlurmControl(Protocol):
    """Submit, query, requeue and cancel Slurm jobs.

    Every method raises :class:`~slurm_elastic.errors.SlurmError` (a subclass naming the
    command, its exit status and Slurm's reason) when Slurm refuses or cannot be reached.
    """

    def submit(
        self,
        script: str | os.PathLike[str],
        extra_args: Sequence[str] = (),
        *,
        cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> str:
        """Submit a batch script (its text, or a path); return the job id. ``env``:
        variables added to the submission's environment."""
        ...

    def job_infos(self, job_ref: str) -> list[JobInfo]:
        """All records Slurm has for ``job_ref`` (an array job: one per task)."""
        ...

    def job_state(self, job_ref: str) -> JobState:
        """The state of one job or one array task."""
        ...

    def requeue(self, job_ref: str, *, hold: bool = False) -> None:
        """Requeue one job or one array task (``12_3``), optionally held."""
        ...

    def cancel(
        self,
        job_ref: str,
        *,
        signal: str | None = None,
        batch: bool = False,
        full: bool = False,
        state: str | None = None,
    ) -> None:
        """Cancel ``job_ref`` (or only signal it); ``state`` limits it to tasks in that
        state (``"PENDING"``: the queued tasks of an array, not the running ones)."""
        ...

    def ping(self) -> bool:
        """Whether the controller answers (never raises on a controller that is down)."""
        ...


def default_control() -> SlurmControl:
    """A :class:`~slurm_elastic.slurm.commands.SlurmClient` with default settings."""
    from slurm_elastic.slurm.commands import SlurmClient

    return SlurmClient()
