"""``SlurmEnv``: everything the agent needs from the ``SLURM_*`` environment.

A pure value object: :meth:`SlurmEnv.from_environ` reads a mapping (tests pass a dict)
and never calls Slurm. The table :data:`VARIABLES` maps each role to the variable Slurm
sets, as submitit does, so the mapping is reviewable in one place.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from slurm_elastic.errors import SlurmEnvError
from slurm_elastic.slurm.hostlist import expand_hostlist

__all__ = ["VARIABLES", "SlurmEnv"]

#: role -> the variable Slurm sets for it (first one present wins).
VARIABLES: dict[str, tuple[str, ...]] = {
    "job_id": ("SLURM_JOB_ID", "SLURM_JOBID"),
    "array_job_id": ("SLURM_ARRAY_JOB_ID",),
    "array_task_id": ("SLURM_ARRAY_TASK_ID",),
    "restart_count": ("SLURM_RESTART_COUNT",),
    "node_name": ("SLURMD_NODENAME",),
    "nodelist": ("SLURM_JOB_NODELIST", "SLURM_NODELIST"),
    "num_nodes": ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
    "node_id": ("SLURM_NODEID",),
    "procid": ("SLURM_PROCID",),
    "cpus_on_node": ("SLURM_CPUS_ON_NODE",),
    "gpus_per_node": ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"),
    "partition": ("SLURM_JOB_PARTITION",),
    "submit_dir": ("SLURM_SUBMIT_DIR",),
    "job_name": ("SLURM_JOB_NAME",),
    "cluster_name": ("SLURM_CLUSTER_NAME",),
}

_GPU_COUNT = re.compile(r"(?:^|:)(\d+)(?:\(|$)")


def _get(env: Mapping[str, str], role: str) -> str | None:
    for name in VARIABLES[role]:
        value = env.get(name)
        if value not in (None, ""):
            return value
    return None


def _int(env: Mapping[str, str], role: str) -> int | None:
    raw = _get(env, role)
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError as exc:
        name = next(n for n in VARIABLES[role] if env.get(n) == raw)
        raise SlurmEnvError(
            f"{name}={raw!r} is not an integer; unset it or run inside a Slurm job"
        ) from exc
    if value < 0:
        raise SlurmEnvError(f"{VARIABLES[role][0]}={raw!r} must not be negative")
    return value


def _gpus(env: Mapping[str, str]) -> int | None:
    raw = _get(env, "gpus_per_node")
    if raw is None:
        return None
    # Forms: "4", "gpu:4", "a100:4", "gpu:a100:4(IDX:0-3)", "4,4" (per-node list: take the first).
    first = raw.split(",")[0].strip()
    m = _GPU_COUNT.search(first)
    if not m:
        raise SlurmEnvError(
            f"SLURM_GPUS_ON_NODE/SLURM_GPUS_PER_NODE={raw!r} has no GPU count; "
            "expected e.g. '4' or 'gpu:4'"
        )
    return int(m.group(1))


def _cpus(env: Mapping[str, str]) -> int | None:
    raw = _get(env, "cpus_on_node")
    if raw is None:
        return None
    try:
        return int(raw.split("(")[0].split(",")[0])
    except ValueError as exc:
        raise SlurmEnvError(f"SLURM_CPUS_ON_NODE={raw!r} is not an integer") from exc


@dataclass(frozen=True)
class SlurmEnv:
    """What the agent needs to know from Slurm about its job and node.

    Every field is ``None`` (or empty) outside Slurm; ``in_slurm`` tells which.
    """

    job_id: str | None = None
    array_job_id: str | None = None
    array_task_id: int | None = None
    restart_count: int = 0
    node_name: str | None = None
    nodelist: tuple[str, ...] = ()
    num_nodes: int | None = None
    node_id: int | None = None
    procid: int | None = None
    cpus_on_node: int | None = None
    gpus_per_node: int | None = None
    partition: str | None = None
    submit_dir: Path | None = None
    job_name: str | None = None
    cluster_name: str | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> SlurmEnv:
        """Parse ``environ`` (e.g. ``os.environ``).

        Raises:
            SlurmEnvError: a variable is malformed (names it and the value).
        """
        nodelist_raw = _get(environ, "nodelist")
        submit_dir = _get(environ, "submit_dir")
        return cls(
            job_id=_get(environ, "job_id"),
            array_job_id=_get(environ, "array_job_id"),
            array_task_id=_int(environ, "array_task_id"),
            # Slurm leaves SLURM_RESTART_COUNT unset on the first run (not "0").
            restart_count=_int(environ, "restart_count") or 0,
            node_name=_get(environ, "node_name"),
            nodelist=tuple(expand_hostlist(nodelist_raw)) if nodelist_raw else (),
            num_nodes=_int(environ, "num_nodes"),
            node_id=_int(environ, "node_id"),
            procid=_int(environ, "procid"),
            cpus_on_node=_cpus(environ),
            gpus_per_node=_gpus(environ),
            partition=_get(environ, "partition"),
            submit_dir=Path(submit_dir) if submit_dir else None,
            job_name=_get(environ, "job_name"),
            cluster_name=_get(environ, "cluster_name"),
        )

    @property
    def in_slurm(self) -> bool:
        """True inside a Slurm job (``SLURM_JOB_ID`` is set)."""
        return self.job_id is not None

    @property
    def is_array_task(self) -> bool:
        """True for one task of an ``sbatch --array`` job."""
        return self.array_job_id is not None and self.array_task_id is not None

    @property
    def run_id(self) -> str | None:
        """The rendezvous run id: shared by all tasks of an array, stable across requeues."""
        return self.array_job_id or self.job_id

    @property
    def own_job_ref(self) -> str | None:
        """What to ``scontrol requeue`` to requeue only this node: ``A_T`` or the job id."""
        if self.is_array_task:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id
