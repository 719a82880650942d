"""Submission to Slurm: the rendered sbatch template is the job script, sent as is.

One generator. ``slurm-elastic render``, ``slurm-elastic submit [--dry-run]``,
:func:`~slurm_elastic.submit.plan_submission` and :func:`~slurm_elastic.submit.submit`
render the same template (:func:`~slurm_elastic.submit.render.render_template`) from
the same flat values, and a submission sends exactly that text to ``sbatch`` through the
:class:`~slurm_elastic.slurm.control.SlurmControl` seam (on its standard input: Slurm
stores and runs that text). The dry run *is* the submission, as in torchx
(``schedule(submit_dryrun(...))``): :func:`plan` builds it once, :func:`send` sends it.

So every path gets what the templates do: ``--signal=B:SIG@lead`` (the notice goes to
the batch shell, which hands it to the agent it ``exec``-s, blocked until the agent has
its handler), ``--requeue`` (or ``--requeue=expedite``), appended logs, and on each node
``slurm-elastic agent ENTRYPOINT ARGS``: nothing is pickled on the submitting side or
unpickled on the nodes.

Shapes (the templates' modes): ``elastic_array``, a job array of ``max_nodes``
single-node tasks, each task one agent, each requeued on its own; ``elastic`` /
``fault_tolerant``, one job of ``min_nodes-max_nodes`` / ``nodes`` nodes, one agent
per node (``srun``).

``python=`` (the Python submission's ``python`` argument, submitit's convention) sets the
template's ``launcher`` to ``PYTHON -m slurm_elastic.cli.main`` unless the values name
one; without it the script is byte for byte what ``slurm-elastic render`` prints for the
same job file.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from slurm_elastic import envvars
from slurm_elastic.slurm.control import SlurmControl, default_control
from slurm_elastic.submit import render
from slurm_elastic.submit.directories import ensure_job_directories
from slurm_elastic.submit.job import SlurmJob
from slurm_elastic.submit.request import JobRequest

__all__ = ["SlurmSubmission", "log_paths", "plan", "sbatch_text", "send", "submit_slurm"]

log = logging.getLogger(__name__)

_SBATCH_LINE = re.compile(r"^#SBATCH --([\w-]+)=(.*)$", re.MULTILINE)


@dataclass(frozen=True)
class SlurmSubmission:
    """One Slurm submission, built and not yet sent.

    Attributes:
        request: the validated request.
        values: the flat values the script was rendered from (``mode`` included).
        text: the sbatch script: what the dry run prints and :func:`send` sends.
    """

    request: JobRequest
    values: Mapping[str, object]
    text: str


def _values(request: JobRequest, python: str | None) -> dict[str, object]:
    values: dict[str, object] = {"mode": request.mode, **request.values}
    if python is not None and "launcher" not in values:
        values["launcher"] = f"{python} -m slurm_elastic.cli.main"
    return values


def plan(request: JobRequest, python: str | None = None) -> SlurmSubmission:
    """Render ``request``'s template: the submission, byte for byte.

    Raises:
        ConfigError: a bad value (the renderer's message names the key and the fix).
    """
    values = _values(request, python)
    return SlurmSubmission(request, values, render.render_template(request.mode, values))


def sbatch_text(request: JobRequest, python: str | None = None) -> str:
    """The sbatch script a submission of ``request`` sends (the dry run)."""
    return plan(request, python).text


def log_paths(submission: SlurmSubmission, job_id: str) -> list[Path]:
    """Where Slurm writes the job's output: the script's ``--output`` pattern, expanded as
    Slurm does (``%x`` job name, ``%j``/``%A`` job id, ``%a`` task), from the submit
    directory."""
    options = dict(_SBATCH_LINE.findall(submission.text))
    pattern = options.get("output", "slurm-%j.out").replace("%x", options.get("job-name", ""))
    pattern = pattern.replace("%j", job_id).replace("%A", job_id)
    tasks = range(submission.request.max_nodes) if "%a" in pattern else [None]
    return [Path(pattern.replace("%a", str(t))).absolute() for t in tasks]


def send(submission: SlurmSubmission, client: SlurmControl | None = None) -> SlurmJob:
    """Submit ``submission.text`` through the Slurm seam; return a handle.

    The directories Slurm opens before the script runs (``output_dir``, ``--chdir``) are
    created first, as ``slurm-elastic render`` does.

    Raises:
        SlurmError: sbatch refused the job (the message has Slurm's reason) or is missing.
    """
    for line in ensure_job_directories(submission.values):
        log.info("%s", line)
    control = client if client is not None else default_control()
    # A new id per submission, outside the script (which stays the dry run's text): the
    # agents tell this job from an earlier one whose id Slurm repeats (agent/run_owner.py).
    job_id = control.submit(submission.text, env={envvars.SUBMISSION_ENV: secrets.token_hex(8)})
    request = submission.request
    if request.mode == "elastic_array":
        refs = [f"{job_id}_{i}" for i in range(request.max_nodes)]
    else:
        refs = [job_id]
    log.info("submitted %s job %s (%d task(s))", request.mode, job_id, len(refs))
    return SlurmJob(job_id, refs, control, submission.text, log_paths(submission, job_id))


def submit_slurm(
    request: JobRequest, client: SlurmControl | None = None, python: str | None = None
) -> SlurmJob:
    """``send(plan(request, python), client)``: submit exactly the dry run's script."""
    return send(plan(request, python), client)
