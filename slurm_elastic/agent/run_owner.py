"""Which cluster a run id belongs to: clusters that share a filesystem repeat job ids.

The run id is the Slurm job id (the array's), the same across requeues, and it names the
run's default checkpoint directory (``<state_dir>/checkpoints/<run_id>``): that is how a
requeued job finds its checkpoints. Clusters number their jobs independently, so a job of
one cluster can get the id of an earlier job of another that ran in the same directory,
and would take that job's rendezvous and checkpoints as its own (the same script: the
same model, so nothing would even fail). The first agent of a run records its cluster
(``SLURM_CLUSTER_NAME``) beside the run key; an agent of another cluster refuses to start
(:class:`~slurm_elastic.errors.RunIdInUseError`), naming the fix.

A federation's job ids are unique across its clusters (the origin cluster's number is in
their upper bits, from ``2**26`` up), and a requeued federated job may run on a sibling
cluster: such ids are not checked.

Not covered: a job id repeated on the *same* cluster (a controller whose state was reset
restarts its ids): nothing Slurm tells a job distinguishes it from a requeue (README,
Limits).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from slurm_elastic.errors import RunIdInUseError, UnsafeDirectoryError
from slurm_elastic.privatefs import SafeDir, publish_exclusive
from slurm_elastic.privatefs.files import read_regular

__all__ = ["check_run_cluster"]

_LIMIT = 4096
_FEDERATED_IDS = 2**26  # Slurm: federated job ids carry the origin cluster's number from here


def _federated(run_id: str) -> bool:
    return run_id.isdigit() and int(run_id) >= _FEDERATED_IDS


def check_run_cluster(directory: str | os.PathLike[str], run_id: str, cluster: str | None) -> None:
    """Record ``cluster`` as the owner of ``run_id`` (first agent), or check it.

    Args:
        directory: the run key's private directory (shared by every node of the run).
        run_id: the run id (a file name component).
        cluster: this job's ``SLURM_CLUSTER_NAME``; ``None`` (outside Slurm, or a Slurm
            that does not set it): nothing is recorded or checked.

    Raises:
        RunIdInUseError: the run id was recorded by a job of another cluster.
        UnsafeDirectoryError: the directory or the record is not private, or damaged.
    """
    if not cluster or _federated(run_id):
        return
    name = f"{run_id}.owner"
    if "/" in name or name.startswith("."):
        raise ValueError(f"{run_id!r} is not a run id")
    where = Path(directory) / name
    with SafeDir.open_checked(directory, follow=False) as held:  # ours, private, no link
        for _ in range(2):
            try:
                got = read_regular(name, limit=_LIMIT, dir_fd=held.fd, owned=True)
            except OSError as exc:
                raise UnsafeDirectoryError(f"run owner record {where}: {exc}") from exc
            if got is None:  # the first agent of the run: the first complete record wins
                record = json.dumps({"cluster": cluster, "run_id": run_id}).encode()
                publish_exclusive(name, record, dir_fd=held.fd, fsync=True)
                continue
            try:
                recorded = json.loads(got[0])["cluster"]
            except (ValueError, KeyError, TypeError) as exc:
                raise UnsafeDirectoryError(
                    f"run owner record {where} is damaged ({exc}); remove it when no agent "
                    f"of run {run_id!r} is running: rm {where}"
                ) from exc
            if recorded != cluster:
                raise RunIdInUseError(
                    f"run id {run_id!r} (this job's id) was used in this state directory by "
                    f"a job of cluster {recorded!r}; this job runs on {cluster!r}, whose job "
                    "ids repeat the other's. Its rendezvous and checkpoints are not this "
                    "job's: give this job its own run_id or state_dir (e.g. "
                    f"state_dir: .slurm_elastic/{cluster})"
                )
            return
        raise UnsafeDirectoryError(f"run owner record {where} vanished while being created")
