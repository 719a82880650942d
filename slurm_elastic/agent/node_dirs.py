"""The agent's node-local directory, and the removal of those killed agents left behind.

Each agent keeps its node's notice, progress and channel files in a private directory
of the system temporary directory (``tempfile.mkdtemp``: ``0700``), removed when the
agent exits. An agent killed with SIGKILL (Slurm's kill after a time limit, an OOM kill)
cannot remove it. So the name carries the agent's pid and the start time of that
process (``slurm-elastic-node-<pid>.<start>-<random>``), and every agent, at start,
removes the directories of agents that are gone: ours (this uid), not a link, named
after a pid that no longer runs or now runs another process (another start time).
Directories of earlier versions (no pid in the name) are left alone: nothing tells
whether their agent still runs.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from slurm_elastic import procstat

__all__ = ["PREFIX", "create", "sweep"]

log = logging.getLogger(__name__)

PREFIX = "slurm-elastic-node-"
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)\.(\d+)-")


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), or ``None`` if gone."""
    found = procstat.read(pid)
    return None if found is None else found.start_time


def create() -> Path:
    """Create this agent's node directory (``0700``) and return it."""
    pid = os.getpid()
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{pid}.{_start_time(pid) or 0}-"))


def sweep(directory: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the node directories of agents that are gone; return them.

    Best effort: what cannot be inspected or removed is left (logged at DEBUG).
    """
    base = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    removed: list[Path] = []
    try:
        entries = os.listdir(base)
    except OSError as exc:
        log.debug("cannot list %s for stale node directories: %s", base, exc)
        return removed
    uid = os.geteuid()
    for name in entries:
        match = _NAME.match(name)
        if match is None:
            continue
        path = base / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            continue  # a link or someone else's: never ours to remove
        pid, started = int(match.group(1)), int(match.group(2))
        if _start_time(pid) == started:
            continue  # its agent still runs
        try:
            shutil.rmtree(path)  # fd-based on Linux: a link inside is removed, not followed
        except OSError as exc:
            log.debug("cannot remove stale node directory %s: %s", path, exc)
            continue
        removed.append(path)
    if removed:
        log.info(
            "removed %d node directories of agents that are gone (killed before they "
            "could clean up): %s",
            len(removed),
            ", ".join(str(p) for p in removed),
        )
    return removed
