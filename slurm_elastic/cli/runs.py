"""Find a run from what the user types: a Slurm job id, an array job id, or a directory.

:func:`locate` resolves ``JOB`` for ``slurm-elastic status|logs|timeline``, in this order:

1. an existing directory: a run's events directory (holds ``*.jsonl``), a state directory
   (holds ``events/<run_id>/``; with several runs, name one by its events directory), or
   a local job's folder (holds ``state/``);
2. a run id (``12``, ``12_3`` -> ``12``, ``local-3f2a...``) in the per-user run index the
   agents write at start (:func:`slurm_elastic.events.record_run`): works after Slurm
   forgot the job;
3. a Slurm job still known to Slurm: ``scontrol show job`` gives its ``WorkDir``, whose
   ``.slurm_elastic/events/<id>`` is the agents' default.

Anything else is a :class:`RunNotFoundError` naming the value and what was looked at.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from slurm_elastic import events
from slurm_elastic.errors import RunNotFoundError, SlurmError
from slurm_elastic.slurm.commands import SlurmClient
from slurm_elastic.slurm.parse import parse_scontrol_show_job

__all__ = ["RunLocation", "RunNotFoundError", "from_index", "locate"]

log = logging.getLogger(__name__)

_JOB_REF = re.compile(r"^(?P<job>[0-9]+)(?:_(?P<task>[0-9]+|\[[0-9,\-%]+\]))?$")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class RunLocation:
    """Where one run keeps its state.

    Attributes:
        run_id: the run id (the array job id, the job id, or ``local-...``).
        events_dir: the directory of the run's event files.
        state_dir: the state directory (``None`` when only the events dir is known).
        slurm_job: the Slurm job id to ask about task states (``None`` for local runs).
        output_files: the node output files known besides the events (local nodes'
            ``node<i>.log``, Slurm's ``StdOut`` files).
        log_dir: the workers' log directory when the run index names one besides the
            state directory (``log_dir`` configured); files the events name are read only
            inside ``state_dir`` and ``log_dir``.
    """

    run_id: str
    events_dir: Path
    state_dir: Path | None = None
    slurm_job: str | None = None
    output_files: list[Path] = field(default_factory=list)
    log_dir: Path | None = None


def _is_slurm_id(run_id: str) -> bool:
    return run_id.isdigit()


def _from_events_dir(
    path: Path, state_dir: Path | None = None, entry: events.RunIndexEntry | None = None
) -> RunLocation:
    """``entry``: the run index entry already read for this run (else looked up)."""
    run_id = path.name
    local_folder = None
    if (
        state_dir is not None
        and state_dir.name == "state"
        and (state_dir.parent / "spec.json").exists()
    ):
        local_folder = state_dir.parent
    outputs = sorted(local_folder.glob("node*.log")) if local_folder is not None else []
    return RunLocation(
        run_id=run_id,
        events_dir=path,
        state_dir=state_dir,
        slurm_job=run_id if _is_slurm_id(run_id) else None,
        output_files=outputs,
        log_dir=_indexed_log_dir(run_id, path, entry),
    )


def _indexed_log_dir(
    run_id: str, events_dir: Path, entry: events.RunIndexEntry | None = None
) -> Path | None:
    """The log directory the (private) run index records for the run of ``events_dir``."""
    if entry is None and _RUN_ID.match(run_id):
        entry = events.find_run(run_id)
    if entry is None or not entry.log_dir:
        return None
    if os.path.realpath(entry.events_dir) != os.path.realpath(events_dir):
        return None  # another run of the same name: its directories are not this one's
    return Path(entry.log_dir)


def _from_directory(path: Path) -> RunLocation:
    if any(path.glob("*.jsonl")):
        parent = path.parent.parent if path.parent.name == "events" else None
        return _from_events_dir(path, parent)
    for state in (path / "state", path / ".slurm_elastic", path):
        runs = sorted(p for p in (state / "events").glob("*") if p.is_dir())
        if len(runs) == 1:
            return _from_events_dir(runs[0], state)
        if len(runs) > 1:
            names = ", ".join(str(r) for r in runs[:5])
            raise RunNotFoundError(
                f"{str(path)!r} holds {len(runs)} runs; name one by its events directory "
                f"or job id: {names}"
            )
    raise RunNotFoundError(
        f"{str(path)!r} is no run directory: it holds no event files (*.jsonl) and no "
        "events/<run_id>/ directory; pass the job id or the run's state directory"
    )


def _from_slurm(job: str, client: SlurmClient) -> RunLocation | None:
    try:
        proc = client.run(["scontrol", "show", "job", "--oneliner", job])
    except SlurmError as exc:
        log.debug("scontrol show job %s: %s", job, exc)
        return None
    records = parse_scontrol_show_job(proc.stdout)
    if not records:
        return None
    workdir = records[0].get("WorkDir")
    if not workdir:
        return None
    state = Path(workdir) / ".slurm_elastic"
    outputs = sorted({Path(r["StdOut"]) for r in records if r.get("StdOut")})
    return RunLocation(
        run_id=job,
        events_dir=state / "events" / job,
        state_dir=state,
        slurm_job=job,
        output_files=outputs,
    )


def from_index(entry: events.RunIndexEntry) -> RunLocation | None:
    """The run a run index entry names; ``None`` when its events directory is gone."""
    events_dir = Path(entry.events_dir)
    if not events_dir.is_dir():
        return None
    return _from_events_dir(events_dir, Path(entry.state_dir), entry)


def locate(job: str, client: SlurmClient | None = None) -> RunLocation:
    """Resolve ``job`` (a Slurm job/array id, a run id or a directory) to its run.

    Args:
        job: what the user typed.
        client: the Slurm seam (default ``SlurmClient()``); only asked when the run index
            does not know the id.

    Raises:
        RunNotFoundError: nothing matches; the message names the value and the places
            looked at.
    """
    path = Path(job).expanduser()
    if path.is_dir():
        return _from_directory(path.resolve())
    if os.sep in job or job.startswith("."):
        raise RunNotFoundError(f"{job!r}: no such directory; pass a job id or a run's directory")
    match = _JOB_REF.match(job)
    run_id = match.group("job") if match else job
    if not _RUN_ID.match(run_id):
        raise RunNotFoundError(
            f"{job!r} is neither a Slurm job id (e.g. 1234 or 1234_5), a run id nor a directory"
        )
    entry = events.find_run(run_id)
    if entry is not None and Path(entry.events_dir).is_dir():
        base = _from_events_dir(Path(entry.events_dir), Path(entry.state_dir), entry)
        outputs = base.output_files
        if _is_slurm_id(run_id):
            found = _from_slurm(run_id, client or SlurmClient())
            outputs = found.output_files if found is not None else outputs
        return RunLocation(
            run_id, base.events_dir, base.state_dir, base.slurm_job, outputs, base.log_dir
        )
    if _is_slurm_id(run_id):
        found = _from_slurm(run_id, client or SlurmClient())
        if found is not None:
            return found
    index = events.run_index_dir()
    raise RunNotFoundError(
        f"no run {run_id!r}: not in the run index ({index}) and Slurm does not know the job; "
        "pass the run's state directory (e.g. <submit dir>/.slurm_elastic) instead"
    )
