"""``submit``/``plan_submission``/``submit_from_config``: the public submission API."""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from slurm_elastic.errors import ConfigError, SlurmError
from slurm_elastic.slurm.control import SlurmControl, default_control
from slurm_elastic.submit import local, render, slurm_backend
from slurm_elastic.submit.job import JobHandle, JobState
from slurm_elastic.submit.request import JobRequest, build_request

__all__ = [
    "CLUSTERS",
    "SubmissionPlan",
    "plan_submission",
    "resolve_cluster",
    "submit",
    "submit_from_config",
]

log = logging.getLogger(__name__)

CLUSTERS = ("local", "slurm")
#: Arguments of :func:`submit` and the CLI that are not values of a job file.
_NOT_JOB_KEYS = frozenset({"cluster", "folder", "python", "client", "dry_run", "wait"})


@dataclass(frozen=True)
class SubmissionPlan:
    """What a submission would do (a dry run).

    Attributes:
        cluster: ``"slurm"`` or ``"local"``.
        request: the validated request.
        text: for Slurm the exact sbatch script; for local the node command lines and the
            node spec.
    """

    cluster: str
    request: JobRequest
    text: str

    def __str__(self) -> str:
        return self.text


def resolve_cluster(cluster: str | None, client: SlurmControl | None = None) -> str:
    """``"local"``/``"slurm"`` as given; ``None``/``"auto"``: Slurm when reachable, else local.

    Raises:
        ConfigError: an unknown cluster name.
    """
    if cluster not in (None, "auto", *CLUSTERS):
        raise ConfigError(f"cluster {cluster!r}: choose 'local', 'slurm' or 'auto'")
    if cluster in CLUSTERS:
        return str(cluster)
    if shutil.which("sbatch") is None or shutil.which("srun") is None:
        return "local"
    try:
        probe = client if client is not None else default_control()
        reachable = bool(probe.ping())
    except SlurmError as exc:
        log.info("Slurm is not usable (%s): running locally", exc)
        return "local"
    if not reachable:
        log.info("slurmctld does not answer 'scontrol ping': running locally")
        return "local"
    return "slurm"


def _no_slurm() -> None:
    """The Slurm version of a local run: none (``expedited_requeue`` has no effect there)."""
    return None


def _request(
    entrypoint: str | None,
    args: object,
    mode: str | None,
    module: bool,
    values: Mapping[str, object],
    cluster: str,
) -> JobRequest:
    return build_request(
        values,
        entrypoint=entrypoint,
        args=args,
        mode=mode,
        module=module,
        slurm_version=None if cluster == "slurm" else _no_slurm,
    )


def _local_plan(request: JobRequest, folder: str | os.PathLike[str] | None) -> str:
    base = Path(folder).resolve() if folder is not None else Path("<new temporary directory>")
    spec = {
        "overrides": local.local_overrides(request, base),
        "entrypoint": request.entrypoint,
        "args": list(request.args),
        "module": request.module,
    }
    lines = [
        f"# local job: {local.node_count(request)} agents ({request.mode}), folder {base}",
        f"# {base / 'spec.json'}:",
        *("#   " + line for line in json.dumps(spec, indent=2, sort_keys=True).splitlines()),
    ]
    cmd = shlex.join(local.node_command(base / "spec.json"))
    lines += [f"{cmd} > {base / f'node{i}.log'} 2>&1 &" for i in range(local.node_count(request))]
    return "\n".join(lines) + "\n"


def plan_submission(
    entrypoint: str | None = None,
    args: object = None,
    *,
    mode: str | None = None,
    cluster: str | None = None,
    folder: str | os.PathLike[str] | None = None,
    module: bool = False,
    python: str | None = None,
    **values: object,
) -> SubmissionPlan:
    """What :func:`submit` with the same arguments would do, without doing it.

    Raises:
        ConfigError: see :func:`submit`.
    """
    chosen = resolve_cluster(cluster)
    request = _request(entrypoint, args, mode, module, values, chosen)
    if chosen == "slurm":
        return SubmissionPlan("slurm", request, slurm_backend.sbatch_text(request, python))
    return SubmissionPlan("local", request, _local_plan(request, folder))


def submit(
    entrypoint: str | None = None,
    args: object = None,
    *,
    mode: str | None = None,
    cluster: str | None = None,
    folder: str | os.PathLike[str] | None = None,
    module: bool = False,
    python: str | None = None,
    client: SlurmControl | None = None,
    **values: object,
) -> JobHandle:
    """Submit an elastic training run; one agent per node runs ``entrypoint``.

    Args:
        entrypoint: the training script (or module with ``module=True``).
        args: its arguments (a list, or one string of shell words).
        mode: ``elastic_array`` (default: an array of single-node tasks), ``elastic``
            (one ``--nodes=MIN-MAX`` job) or ``fault_tolerant`` (``nodes`` fixed).
        cluster: ``"slurm"``, ``"local"`` (N agent processes on this machine), or
            ``None``/``"auto"``: Slurm when reachable, else local.
        folder: local jobs: their directory (default: a new temporary directory).
        module: run ``python -m entrypoint``.
        python: Slurm jobs: the python on the nodes; the script's launcher becomes
            ``PYTHON -m slurm_elastic.cli.main`` (unless ``launcher`` is given). Default:
            the template's ``launcher`` (``slurm-elastic`` on the job's ``PATH``; sbatch
            passes the submitting environment), so the script is byte for byte what
            ``slurm-elastic render`` prints for the same values.
        client: Slurm jobs: the Slurm seam that submits and polls (default
            ``SlurmClient()``). The job starts with sbatch's environment: this process's,
            or the client's ``env`` when it was given one.
        **values: config keys (``nnodes="1:4"``, ``max_restarts=3``, ...) and template
            keys (``partition``, ``time``, ``setup``, ``output_dir``, ...), as in
            ``slurm-elastic render``.

    Returns:
        A :class:`~slurm_elastic.submit.job.JobHandle`: ``state()``, ``wait(timeout_s)``,
        ``cancel()``, ``log_paths()``.

    Raises:
        ConfigError: unknown key or mode, missing entrypoint, bad value.
        SlurmError: Slurm refused the job or is unreachable.
    """
    chosen = resolve_cluster(cluster, client)
    request = _request(entrypoint, args, mode, module, values, chosen)
    if chosen == "slurm":
        return slurm_backend.submit_slurm(request, client=client, python=python)
    return local.submit_local(request, folder)


def submit_from_config(
    path: str | os.PathLike[str],
    *,
    cluster: str | None = None,
    dry_run: bool = False,
    wait: bool = False,
    overrides: Mapping[str, object] | None = None,
    timeout_s: float | None = None,
    out: TextIO | None = None,
    progress: Callable[[str, str], None] | None = None,
) -> int:
    """``slurm-elastic submit CONFIG.yaml``: submit (or print) the job a YAML file describes.

    The YAML is a flat mapping of config keys, template keys, ``mode`` and
    ``entrypoint``/``args`` - the same file ``slurm-elastic render`` takes.

    ``progress(job_id, state)`` is called at each poll while waiting.

    Returns:
        The process exit status: 0 submitted (or, with ``wait``, completed), 1 the job
        did not complete.

    Raises:
        ConfigError: unreadable file or bad values.
        SlurmError: Slurm refused the job.
    """
    stream = sys.stdout if out is None else out
    from slurm_elastic.yamlfile import load_mapping

    values = load_mapping(path, "job file")
    for key in sorted(set(values) & _NOT_JOB_KEYS):
        flag = f"--{key.replace('_', '-')}"
        raise ConfigError(
            f"job file {os.fspath(path)!r}: {key!r} is not a job value; drop it and pass "
            f"{flag} on the command line (e.g. slurm-elastic submit JOB.yaml {flag} ...)"
            if key in ("cluster", "dry_run", "wait")
            else f"job file {os.fspath(path)!r}: {key!r} is not a job value; drop it"
        )
    # The file's values are checked on their own first, so that an error names the file
    # (the merged values below would be reported as "the job values").
    render.job_config(values, source=f"job file {os.fspath(path)!r}")
    values.update(overrides or {})
    if dry_run:
        plan = plan_submission(cluster=cluster, **values)
        stream.write(plan.text)
        return 0
    job = submit(cluster=cluster, **values)
    stream.write(f"submitted {job.cluster} job {job.job_id}\n")
    for log_path in job.log_paths():
        stream.write(f"  log: {log_path}\n")
    stream.flush()
    if not wait:
        return 0
    try:
        state = job.wait(timeout_s, poll_s=1.0 if progress else 0.5, on_poll=progress)
    except KeyboardInterrupt:
        job.cancel()
        raise
    stream.write(f"job {job.job_id} {state.value}\n")
    return 0 if state == JobState.COMPLETED else 1
