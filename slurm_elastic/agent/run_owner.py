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

A job id repeated on the *same* cluster (a controller whose state was reset restarts its
ids) looks like a requeue to everything Slurm tells a job. A submission through
``slurm-elastic submit`` or :func:`~slurm_elastic.submit.submit` carries a random id in
its environment (``SLURM_ELASTIC_SUBMISSION``: sbatch hands it to every task and keeps it
across requeues; the script itself is unchanged): the first agent records it too, and an
agent of another submission refuses in the same way. Not covered: a job script sent with
plain ``sbatch`` (no submission id; README, Limits).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from slurm_elastic import envvars
from slurm_elastic.errors import RunIdInUseError, UnsafeDirectoryError
from slurm_elastic.privatefs import SafeDir, publish_exclusive
from slurm_elastic.privatefs.files import read_regular

__all__ = ["check_run_cluster"]

_LIMIT = 4096
_FEDERATED_IDS = 2**26  # Slurm: federated job ids carry the origin cluster's number from here
_SUBMISSION = re.compile(r"[0-9a-f]{16}")


def _federated(run_id: str) -> bool:
    return run_id.isdigit() and int(run_id) >= _FEDERATED_IDS


def check_run_cluster(
    directory: str | os.PathLike[str],
    run_id: str,
    cluster: str | None,
    submission: str | None = None,
) -> None:
    """Record who owns ``run_id`` (the first agent of the run), or check it.

    Args:
        directory: the run key's private directory (shared by every node of the run).
        run_id: the run id (a file name component).
        cluster: this job's ``SLURM_CLUSTER_NAME``; ``None`` (outside Slurm, or a Slurm
            that does not set it): not recorded or checked. Not checked for a federated
            job id either.
        submission: this job's submission id (``SLURM_ELASTIC_SUBMISSION``), ``None``
            for a job sent with plain ``sbatch``: then not recorded or checked.

    Raises:
        RunIdInUseError: the run id was recorded by a job of another cluster, or by
            another submission.
        UnsafeDirectoryError: the directory or the record is not private, or damaged.
        ValueError: ``submission`` is not a submission id.
    """
    if submission is not None and not _SUBMISSION.fullmatch(submission):
        raise ValueError(
            f"{envvars.SUBMISSION_ENV}={submission!r} is not a submission id (16 hex digits, "
            "set by slurm-elastic submit for its job); unset it"
        )
    if _federated(run_id):
        cluster = None  # unique across the federation's clusters; may requeue on a sibling
    if not cluster and submission is None:
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
                record = {"cluster": cluster, "run_id": run_id, "submission": submission}
                publish_exclusive(name, json.dumps(record).encode(), dir_fd=held.fd, fsync=True)
                continue
            try:
                recorded = json.loads(got[0])
                theirs = (recorded["cluster"], recorded.get("submission"))
                if not all(v is None or isinstance(v, str) for v in theirs):
                    raise TypeError("cluster and submission must be strings")
            except (ValueError, KeyError, TypeError) as exc:
                raise UnsafeDirectoryError(
                    f"run owner record {where} is damaged ({exc}); remove it when no agent "
                    f"of run {run_id!r} is running: rm {where}"
                ) from exc
            _check(run_id, theirs, (cluster, submission))
            return
        raise UnsafeDirectoryError(f"run owner record {where} vanished while being created")


def _check(
    run_id: str, theirs: tuple[str | None, str | None], ours: tuple[str | None, str | None]
) -> None:
    """Refuse when the recorded cluster or submission is known on both sides and differs."""
    (their_cluster, their_submission), (cluster, submission) = theirs, ours
    if their_cluster and cluster and their_cluster != cluster:
        raise RunIdInUseError(
            f"run id {run_id!r} (this job's id) was used in this state directory by "
            f"a job of cluster {their_cluster!r}; this job runs on {cluster!r}, whose job "
            "ids repeat the other's. Its rendezvous and checkpoints are not this "
            "job's: give this job its own run_id or state_dir (e.g. "
            f"state_dir: .slurm_elastic/{cluster})"
        )
    if their_submission and submission and their_submission != submission:
        raise RunIdInUseError(
            f"run id {run_id!r} (this job's id) was used in this state directory by "
            f"another submission ({their_submission}; this one is {submission}): Slurm "
            "gave this job the id of an earlier job (a controller whose state was reset "
            "restarts its job ids). Its rendezvous and checkpoints are not this job's: "
            "give this job its own run_id or state_dir"
        )
