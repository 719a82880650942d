"""Submission to Slurm through submitit: request -> submitit parameters -> sbatch text.

Shapes:

* ``elastic_array``: a job array of ``max_nodes`` single-node tasks (``map_array``), each
  task one agent; the run starts with the first task (``min_nodes``) and each task
  requeues only itself.
* ``fault_tolerant`` / ``elastic``: one job of ``nodes`` / ``min_nodes-max_nodes`` nodes,
  one task per node (srun), each task one agent.

Signals: Slurm sends ``preempt_signal`` (default USR2) ``signal_lead_s`` seconds before
the end, to every process of the job step (``--signal=SIG@lead``, no ``B:``: with srun
the agents are in the step); ``SUBMITIT_PREEMPT_SIGNAL`` is exported with the same name
so submitit's own machinery agrees, and :func:`~slurm_elastic.submit.node.run_node`
replaces submitit's job-side handlers (we do not use its Checkpointable requeue: our
agent requeues its own task only). ``--requeue`` is set (``--requeue=expedite`` with
``expedited_requeue``); submitit already appends to logs (``--open-mode=append``).

The dry run calls the same submitit function that renders the sbatch file of a real
submission (``submitit.slurm.slurm._make_sbatch_string``, through
``SlurmExecutor._make_submission_file_text``), so it prints exactly what would be sent;
after a submission, :func:`submit_slurm` compares the file submitit wrote with it. That
function is private to submitit: :func:`submitit_sbatch_string` is the only place that
touches submitit's private API, ``tests/submit/test_submitit_contract.py`` fails loudly
when submitit changes it, and pyproject bounds submitit to the tested range (1.5.x).

The Slurm options (partition, time, ...) map to submitit parameters through the same
table as the ``#SBATCH`` lines of the templates
(:data:`slurm_elastic.submit.render.SBATCH_OPTIONS`).
"""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path
from typing import Any

from slurm_elastic.envvars import SIGNAL_LEAD_ENV
from slurm_elastic.errors import ConfigError, SlurmCommandNotFoundError
from slurm_elastic.privatefs import ensure_private_dir
from slurm_elastic.slurm.control import SlurmControl, default_control
from slurm_elastic.submit import render
from slurm_elastic.submit.job import SlurmJob
from slurm_elastic.submit.request import JobRequest

__all__ = ["sbatch_text", "submit_slurm", "submitit_parameters", "submitit_sbatch_string"]

log = logging.getLogger(__name__)


# the Slurm time parser moved to the option table's module; kept for its tests
_minutes = render.slurm_time_minutes


def _sbatch_arg(arg: str) -> tuple[str, object]:
    if not arg.startswith("--"):
        raise ConfigError(
            f"sbatch_args entry {arg!r}: use the long form --name=value with submitit"
        )
    key, sep, value = arg[2:].partition("=")
    return key, (value if sep else True)


def submitit_parameters(request: JobRequest) -> dict[str, Any]:
    """The ``SlurmExecutor.update_parameters`` arguments for ``request``."""
    t = request.template
    additional: dict[str, object] = {
        "signal": f"{request.preempt_signal}@{request.signal_lead_s}",
        # --requeue, or --requeue=expedite (checked against the Slurm version)
        "requeue": request.requeue_option.partition("=")[2] or True,
    }
    params: dict[str, Any] = {
        "job_name": request.job_name,
        "ntasks_per_node": 1,
        "signal_delay_s": request.signal_lead_s,
        # submitit's default is 5 minutes; the templates leave it to the partition.
        "time": 24 * 60,
    }
    for opt in render.SBATCH_OPTIONS:
        value = t.get(opt.key)
        if value is None:
            continue
        if opt.boolean:
            if render.boolean_value(opt.key, value):
                params[opt.submitit] = True
        else:
            params[opt.submitit] = opt.to_submitit(value)
    if request.mode == "elastic_array":
        params["nodes"] = 1
        params["array_parallelism"] = request.max_nodes
    else:
        params["nodes"] = request.max_nodes
        if request.min_nodes != request.max_nodes:
            additional["nodes"] = f"{request.min_nodes}-{request.max_nodes}"
        # one agent exiting (finished, preempted) must not take the others down
        params["srun_args"] = ["--kill-on-bad-exit=0", *request.srun_args]
    if request.mode == "elastic_array" and request.srun_args:
        params["srun_args"] = list(request.srun_args)
    for arg in request.sbatch_args:
        key, value = _sbatch_arg(arg)
        additional[key] = value
    params["additional_parameters"] = additional
    params["setup"] = [
        *request.setup_lines,
        *(f"export {k}={shlex.quote(v)}" for k, v in sorted(request.env.items())),
        f"export SUBMITIT_PREEMPT_SIGNAL={request.preempt_signal}",
        f"export {SIGNAL_LEAD_ENV}={request.signal_lead_s}",
    ]
    return params


def _folder(request: JobRequest) -> Path:
    return Path(request.output_dir).resolve() / "%j"


def submitit_sbatch_string(
    folder: Path, python: str, map_count: int | None, params: dict[str, Any]
) -> str:
    """The sbatch script submitit writes for these executor parameters.

    The only function that touches submitit's private API: ``_make_sbatch_string`` (what
    ``SlurmExecutor._make_submission_file_text`` returns) and the ``submitit.core._submit``
    command its executor runs on the nodes (``SlurmExecutor._submitit_command_str``).
    ``tests/submit/test_submitit_contract.py`` checks both against the installed
    submitit.

    Args:
        folder: the executor's folder (with ``%j``).
        python: the python command on the nodes (already shell-quoted).
        map_count: the array size for ``map_array``, else ``None``.
        params: the ``update_parameters`` arguments (:func:`submitit_parameters`).

    Raises:
        ConfigError: submitit rejects a parameter.
    """
    from submitit.slurm import slurm as submitit_slurm

    command = " ".join([python, "-u -m submitit.core._submit", shlex.quote(str(folder))])
    try:
        return str(
            submitit_slurm._make_sbatch_string(
                command=command, folder=folder, map_count=map_count, **params
            )
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"submitit rejected the Slurm parameters {params}: {exc}") from exc


def sbatch_text(request: JobRequest, python: str | None = None) -> str:
    """The sbatch script a real submission of ``request`` sends (a dry run).

    Raises:
        ConfigError: submitit rejects a parameter.
    """
    py = shlex.quote(sys.executable) if python is None else python
    map_count = request.max_nodes if request.mode == "elastic_array" else None
    return submitit_sbatch_string(_folder(request), py, map_count, submitit_parameters(request))


def _check_sent(text: str, submitted: Path) -> None:
    """Warn when the script submitit sent is not the dry run's (a submitit change)."""
    try:
        sent = submitted.read_text(encoding="utf-8")
    except OSError as exc:
        log.debug("cannot read the submitted script %s: %s", submitted, exc)
        return
    if sent != text:
        log.warning(
            "the script submitit sent (%s) differs from `submit --dry-run`; this submitit "
            "version is outside the tested range (see pyproject.toml)",
            submitted,
        )


def submit_slurm(
    request: JobRequest, client: SlurmControl | None = None, python: str | None = None
) -> SlurmJob:
    """Submit ``request`` with submitit; return a handle that polls our Slurm seam.

    Raises:
        SlurmCommandNotFoundError: no ``srun``/``sbatch`` here.
        ConfigError: submitit rejects a parameter.
    """
    import submitit

    from slurm_elastic.submit.node import run_node

    folder = _folder(request)
    # submitit keeps the pickled job there, which the nodes unpickle: 0700, ours only
    ensure_private_dir(Path(request.output_dir).resolve())
    try:
        executor = submitit.SlurmExecutor(folder=folder, python=python)
    except RuntimeError as exc:
        raise SlurmCommandNotFoundError(
            f"cannot submit to Slurm from here ({exc}); use cluster='local' or run on a "
            "login node with srun/sbatch on PATH"
        ) from exc
    try:
        executor.update_parameters(**submitit_parameters(request))
    except ValueError as exc:
        raise ConfigError(f"submitit rejected the Slurm parameters: {exc}") from exc
    text = sbatch_text(request, python=python)
    overrides = dict(request.overrides)
    args = list(request.args)
    if request.mode == "elastic_array":
        n = request.max_nodes
        jobs = executor.map_array(
            run_node, [overrides] * n, [request.entrypoint] * n, [args] * n, [request.module] * n
        )
        job_id = str(jobs[0].job_id).split("_")[0]
        refs = [str(j.job_id) for j in jobs]
    else:
        job = executor.submit(run_node, overrides, request.entrypoint, args, request.module)
        jobs = [job]
        job_id = str(job.job_id)
        refs = [job_id]
    log.info("submitted %s job %s (%d task(s))", request.mode, job_id, len(refs))
    # one submission file per job (an array's tasks point to a per-task folder that
    # does not hold it): <folder with %j = job id>/<job id>_submission.sh
    _check_sent(text, submitit.core.utils.JobPaths(folder, job_id=job_id).submission_file)
    return SlurmJob(job_id, refs, jobs, client or default_control(), text)
