"""The per-user run index: where each run keeps its state, by run id.

Every agent records its run at start (:func:`record_run`): the run id (the Slurm job id)
maps to its state, events, checkpoint and log directories, so ``slurm-elastic status
JOB`` finds a run after Slurm forgot the job, and ``slurm-elastic status`` alone lists
the runs (:func:`list_runs`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from slurm_elastic.errors import UnsafeDirectoryError
from slurm_elastic.privatefs import ensure_private_dir, read_regular, replace_file

__all__ = ["RunIndexEntry", "find_run", "list_runs", "record_run", "run_index_dir"]

log = logging.getLogger(__name__)

#: A run index entry is a few hundred bytes; anything larger is not ours.
_MAX_ENTRY_BYTES = 64 * 1024


@dataclass(frozen=True)
class RunIndexEntry:
    """Where one run keeps its state (what :func:`record_run` wrote)."""

    run_id: str
    state_dir: str
    events_dir: str
    checkpoint_dir: str | None = None
    log_dir: str | None = None
    time: float = 0.0


def run_index_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The per-user run index: ``$XDG_STATE_HOME/slurm_elastic/runs`` (else
    ``~/.local/state/slurm_elastic/runs``)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_STATE_HOME") or os.path.join(
        env.get("HOME") or os.path.expanduser("~"), ".local", "state"
    )
    return Path(base) / "slurm_elastic" / "runs"


def record_run(
    run_id: str,
    *,
    state_dir: str | os.PathLike[str],
    events_dir: str | os.PathLike[str],
    checkpoint_dir: str | os.PathLike[str] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
) -> None:
    """Record where run ``run_id`` keeps its state in the per-user run index.

    Written by every agent at start (atomically, 0600); never raises (best effort).
    """
    entry = RunIndexEntry(
        run_id=run_id,
        state_dir=os.path.abspath(state_dir),
        events_dir=os.path.abspath(events_dir),
        checkpoint_dir=None if checkpoint_dir is None else os.path.abspath(checkpoint_dir),
        log_dir=None if log_dir is None else os.path.abspath(log_dir),
        time=time.time(),
    )
    try:
        directory = run_index_dir()
        ensure_private_dir(directory, root=directory.parent)
        replace_file(
            directory / f"{run_id}.json",
            json.dumps(dataclasses.asdict(entry)).encode(),
            tmp=f".{run_id}.{os.getpid()}.tmp",
            clear_tmp=True,
        )
    except (OSError, ValueError, UnsafeDirectoryError) as exc:
        log.debug("cannot record run %s in the run index: %s", run_id, exc)


def find_run(run_id: str) -> RunIndexEntry | None:
    """The run index entry of ``run_id``; ``None`` when there is none or it is not ours.

    An entry not owned by this user, or a link, is ignored (it could point anywhere).
    """
    path = run_index_dir() / f"{run_id}.json"
    try:
        got = read_regular(path, limit=_MAX_ENTRY_BYTES, owned=True)
    except OSError as exc:  # a link, not a file, another user's, too large
        log.warning("ignoring run index entry %s: %s", path, exc.strerror or exc)
        return None
    if got is None:
        return None
    try:
        data = json.loads(got[0])
        return RunIndexEntry(**{k: data[k] for k in data if k in RunIndexEntry.__annotations__})
    except (ValueError, TypeError) as exc:
        log.warning("ignoring unreadable run index entry %s: %s", path, exc)
        return None


def list_runs() -> list[RunIndexEntry]:
    """Every run of the per-user run index, the most recently started first.

    An entry counts from the last start of one of its agents (each agent rewrites it).
    Entries that :func:`find_run` refuses (a link, not a regular file, another user's,
    unreadable) are left out with its warning, as is one whose name and run id differ.
    """
    directory = run_index_dir()
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("cannot list the run index %s: %s", directory, exc.strerror or exc)
        return []
    found = []
    for name in names:
        run_id = name.removesuffix(".json")
        if run_id == name or name.startswith("."):  # not an entry (a temporary file)
            continue
        entry = find_run(run_id)
        if entry is not None and entry.run_id == run_id:
            found.append(entry)
    return sorted(found, key=lambda e: (e.time, e.run_id), reverse=True)
