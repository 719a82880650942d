"""``cluster="local"``: the same job as N node-agent processes on this machine.

Each local "node" is ``python -m slurm_elastic.cli.node SPEC.json``, i.e. the same
:func:`~slurm_elastic.agent.run_agent` a Slurm task runs, with:

* one fresh run id (``local-<hex>``) unless the config sets ``run_id``;
* a rendezvous directory, state directory and logs under the job folder (a new
  temporary directory unless ``folder`` is given), shared by the N agents;
* ``local_addr=127.0.0.1``;
* ``SLURM_*`` variables removed from their environment, so an agent started from inside
  a Slurm job does not mistake itself for one of its tasks (and requeue it).

N is ``nodes`` (``fault_tolerant``) or ``max_nodes``. Output of node ``i`` goes to
``<folder>/node<i>.log``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slurm_elastic import envvars
from slurm_elastic.privatefs import ensure_private_dir, replace_file
from slurm_elastic.submit.job import LocalJob
from slurm_elastic.submit.request import JobRequest

__all__ = ["local_overrides", "node_command", "node_environment", "submit_local"]

log = logging.getLogger(__name__)


def local_overrides(request: JobRequest, folder: Path) -> dict[str, Any]:
    """The config overrides of the local agents (the request's, plus local defaults)."""
    out = dict(request.overrides)
    out.setdefault("run_id", f"local-{uuid.uuid4().hex[:10]}")
    out.setdefault("state_dir", str(folder / "state"))
    out.setdefault("rdzv_endpoint", str(folder / "rdzv"))
    out.setdefault("local_addr", "127.0.0.1")
    return out


def node_environment(
    environ: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of a local node: ours minus ``SLURM_*`` (``SLURM_ELASTIC_*`` kept)."""
    env = {
        k: v
        for k, v in (os.environ if environ is None else environ).items()
        if not k.startswith("SLURM") or k.startswith(envvars.PREFIX)
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def node_command(spec_path: Path) -> list[str]:
    """The command line of one local node."""
    # a program entry (it configures logging), hence in the CLI package
    return [sys.executable, "-m", "slurm_elastic.cli.node", str(spec_path)]


def write_spec(request: JobRequest, folder: Path) -> tuple[Path, dict[str, Any]]:
    """Write the node spec (JSON) into ``folder``; return its path and content."""
    spec = {
        "overrides": local_overrides(request, folder),
        "entrypoint": request.entrypoint,
        "args": list(request.args),
        "module": request.module,
    }
    path = folder / "spec.json"
    replace_file(path, json.dumps(spec, indent=2, sort_keys=True).encode("utf-8"))
    return path, spec


def node_count(request: JobRequest) -> int:
    """How many local agents the request starts."""
    return request.max_nodes


def submit_local(request: JobRequest, folder: str | os.PathLike[str] | None = None) -> LocalJob:
    """Start the request's agents on this machine and return their handle."""
    base = (
        Path(tempfile.mkdtemp(prefix="slurm-elastic-local-"))
        if folder is None
        else Path(folder).resolve()
    )
    ensure_private_dir(base)
    spec_path, spec = write_spec(request, base)
    env = node_environment(extra=request.env)
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    try:
        for i in range(node_count(request)):
            log_path = base / f"node{i}.log"
            with open(log_path, "ab") as out:
                procs.append(
                    subprocess.Popen(
                        node_command(spec_path),
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                        # own session: a Ctrl-C meant for the submitter does not hit them
                        start_new_session=True,
                    )
                )
            logs.append(log_path)
    except OSError:
        from slurm_elastic.submit import processes

        processes.stop_tree(procs, 0)
        raise
    run_id = str(spec["overrides"]["run_id"])
    grace = float(spec["overrides"].get("shutdown_timeout_s", 60.0)) + 10.0
    log.info("started local job %s: %d agents in %s", run_id, len(procs), base)
    return LocalJob(run_id, base, procs, logs, grace_s=grace)
