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
agent requeues its own task only). ``--requeue`` is set; submitit already appends to logs
(``--open-mode=append``).

The dry run calls the same submitit function that renders the sbatch file of a real
submission (``submitit.slurm.slurm._make_sbatch_string``), so it prints exactly what would
be sent. That function is private to submitit; the version range in pyproject pins what we
tested (submitit 1.5.4).
"""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path
from typing import Any, Protocol

from slurm_elastic.errors import ConfigError, SlurmCommandNotFoundError
from slurm_elastic.slurm import render
from slurm_elastic.slurm.jobstate import JobInfo
from slurm_elastic.submit.job import SlurmJob
from slurm_elastic.submit.request import JobRequest

__all__ = ["JobStateClient", "sbatch_text", "submit_slurm", "submitit_parameters"]

log = logging.getLogger(__name__)


class JobStateClient(Protocol):
    """What :class:`SlurmJob` needs from the Slurm seam (``slurm.commands.SlurmClient``)."""

    def job_infos(self, job_ref: str) -> list[JobInfo]:
        """One record per task of ``job_ref`` (sacct, else scontrol)."""
        ...

    def cancel(self, job_ref: str) -> None:
        """``scancel job_ref``."""
        ...

    def ping(self) -> bool:
        """Whether slurmctld answers."""
        ...


def _minutes(value: object) -> int:
    """Slurm ``--time`` forms (``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    try:
        days = 0
        if "-" in text:
            d, text = text.split("-", 1)
            days = int(d)
            parts = [int(p) for p in text.split(":")] + [0, 0]
            hours, minutes, seconds = parts[0], parts[1], parts[2]
        else:
            parts = [int(p) for p in text.split(":")]
            if len(parts) == 1:
                hours, minutes, seconds = 0, parts[0], 0
            elif len(parts) == 2:
                hours, minutes, seconds = 0, parts[0], parts[1]
            elif len(parts) == 3:
                hours, minutes, seconds = parts
            else:
                raise ValueError(text)
    except ValueError as exc:
        raise ConfigError(
            f"time {value!r}: expected minutes or a Slurm time such as '04:00:00' or '1-12:00'"
        ) from exc
    return days * 1440 + hours * 60 + minutes + (1 if seconds else 0)


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
        "requeue": True,
    }
    params: dict[str, Any] = {
        "job_name": request.job_name,
        "ntasks_per_node": 1,
        "signal_delay_s": request.signal_lead_s,
        "time": _minutes(t["time"]) if t.get("time") is not None else 24 * 60,
    }
    for key in ("partition", "account", "qos", "constraint", "mem", "gpus_per_node"):
        if t.get(key) is not None:
            params[key] = t[key]
    if t.get("cpus_per_task") is not None:
        params["cpus_per_task"] = int(str(t["cpus_per_task"]))
    if render._bool("exclusive", t.get("exclusive", False)):
        params["exclusive"] = True
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
    ]
    return params


def _folder(request: JobRequest) -> Path:
    return Path(request.output_dir).resolve() / "%j"


def sbatch_text(request: JobRequest, python: str | None = None) -> str:
    """The sbatch script a real submission of ``request`` sends (a dry run).

    Raises:
        ConfigError: submitit rejects a parameter.
    """
    from submitit.slurm import slurm as submitit_slurm

    folder = _folder(request)
    py = shlex.quote(sys.executable) if python is None else python
    command = " ".join([py, "-u -m submitit.core._submit", shlex.quote(str(folder))])
    params = submitit_parameters(request)
    map_count = request.max_nodes if request.mode == "elastic_array" else None
    try:
        return str(
            submitit_slurm._make_sbatch_string(
                command=command, folder=folder, map_count=map_count, **params
            )
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"submitit rejected the Slurm parameters {params}: {exc}") from exc


def _default_client() -> JobStateClient:
    try:
        from slurm_elastic.slurm.commands import SlurmClient
    except ImportError as exc:
        raise SlurmCommandNotFoundError(
            "slurm_elastic.slurm.commands is not available; cannot talk to Slurm"
        ) from exc
    client: JobStateClient = SlurmClient()
    return client


def submit_slurm(
    request: JobRequest, client: JobStateClient | None = None, python: str | None = None
) -> SlurmJob:
    """Submit ``request`` with submitit; return a handle that polls our Slurm seam.

    Raises:
        SlurmCommandNotFoundError: no ``srun``/``sbatch`` here.
        ConfigError: submitit rejects a parameter.
    """
    import submitit

    from slurm_elastic.submit.node import run_node

    folder = _folder(request)
    Path(request.output_dir).resolve().mkdir(parents=True, exist_ok=True)
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
    return SlurmJob(job_id, refs, jobs, client or _default_client(), text)
