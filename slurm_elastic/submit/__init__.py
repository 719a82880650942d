"""Submission: run one elastic training job on Slurm (the sbatch templates) or locally.

Concept: a job is ``max_nodes`` (or ``nodes``) copies of the same task, each task one
node's agent (:func:`slurm_elastic.agent.run_agent`), meeting through the shared
rendezvous. The shape follows the modes of the sbatch templates: ``elastic_array`` (job
array, one node per task, the default), ``elastic`` (one ``--nodes=MIN-MAX`` job),
``fault_tolerant`` (one job of fixed ``nodes``). ``cluster="local"`` runs the same tasks
as processes on this machine with a private rendezvous directory (the default when no
Slurm is reachable).

Contract:

* ``submit(entrypoint, args, mode=..., cluster=..., **values) -> JobHandle`` - values
  are the flat config/template keys of ``slurm-elastic render``;
* ``plan_submission(...) -> SubmissionPlan``: the dry run (the exact sbatch script);
* ``submit_from_config(path, cluster=, dry_run=, wait=) -> int`` for the CLI;
* a :class:`JobHandle` reports state through our own Slurm seam (never submitit's sacct
  polling), waits with a deadline (:class:`JobTimeoutError`), and ``cancel()`` of a local
  job leaves no process behind (agents and their workers).

Importing this package imports neither torch nor submitit (submitit is not used on the
Slurm path: a submission sends the rendered template, see
:mod:`slurm_elastic.submit.slurm_backend`).
"""

from slurm_elastic.submit.api import (
    CLUSTERS,
    SubmissionPlan,
    plan_submission,
    resolve_cluster,
    submit,
    submit_from_config,
)
from slurm_elastic.submit.job import (
    JobFailedError,
    JobHandle,
    JobState,
    JobTimeoutError,
    LocalJob,
    SlurmJob,
)
from slurm_elastic.submit.request import JobRequest, build_request

__all__ = [
    "CLUSTERS",
    "JobFailedError",
    "JobHandle",
    "JobRequest",
    "JobState",
    "JobTimeoutError",
    "LocalJob",
    "SlurmJob",
    "SubmissionPlan",
    "build_request",
    "plan_submission",
    "resolve_cluster",
    "submit",
    "submit_from_config",
]
