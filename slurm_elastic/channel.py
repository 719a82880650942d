"""The node channel: the directory through which a node's agent and its workers talk.

One private directory per agent (``0700``, created and removed by the agent:
:mod:`slurm_elastic.agent.node_dirs`) holds every file of the channel. It reaches the
workers as one variable, ``$SLURM_ELASTIC_NODE_DIR``; :class:`NodeChannel` names every
file in it and :meth:`NodeChannel.clear` empties it before workers are (re)started.

Every message between an agent and its workers, in one list:

=================  ==========================================  ===========================
message            carried by (writer -> reader)                format, module
=================  ==========================================  ===========================
notice             ``notice`` file + the preempt signal         ``<reason> <unix time>\\n``;
                   (agent -> workers: checkpoint and leave)     :mod:`slurm_elastic.notice`
progress           ``progress`` file (workers -> agent's hang   one fixed 42-byte line;
                   watchdog)                                    :mod:`slurm_elastic.notice`
registration       ``worker.<local_rank>`` file (worker ->      JSON ``{"pid", "live"}``;
                   agent: it can re-form in place, or starts)   :mod:`slurm_elastic.live.roster`
assignment         ``assign.<local_rank>`` file (agent ->       JSON :class:`~slurm_elastic.
                   worker: a new round's rank and store)        live.roster.Assignment`
restart path       ``restart.<local_rank>`` file (a warm        JSON ``{"pid"}``;
                   worker -> agent: its script made a process   :mod:`slurm_elastic.live.
                   group without ``ElasticSession``)            roster`
closed             ``closed.<local_rank>`` file (worker ->      JSON ``{"pid"}``;
                   agent: its session finished and closed)      :mod:`slurm_elastic.live.roster`
start round        ``$SLURM_ELASTIC_ROUND`` (agent -> workers)  an integer
in place off       ``$SLURM_ELASTIC_IN_PLACE=0`` (the user)     ``0``/``1``
run key            ``$SLURM_ELASTIC_KEY_FILE`` (agent ->        a 0600 file;
                   workers: seals the round's store)            :mod:`slurm_elastic.live.auth`
readiness          ``ready/<rank>`` in the round's store        sealed by the run key;
                   (worker -> the round's other workers)        :mod:`slurm_elastic.live.world`
agent gone         the worker's parent pid changes (the agent   :mod:`slurm_elastic.live.
                   died: the worker leaves at a step boundary)  boundary`
=================  ==========================================  ===========================

The files are read as hostile input (any process of the user can write the directory),
through the shared primitives of :mod:`slurm_elastic.privatefs`:
:func:`read_node_file` never blocks and never follows a link; it opens with
``O_NONBLOCK | O_NOFOLLOW``, refuses what ``fstat`` says is not a regular file (a FIFO,
a directory, a device) and a file larger than its bound, and reads at most that bound.
What it refuses is ignored with a warning naming the file (:func:`warn_ignored`: one per
file per :data:`IGNORED_WARNING_INTERVAL_S`, so a poll loop does not flood the log).
:func:`write_node_file` creates its temporary file exclusively (``O_EXCL | O_NOFOLLOW``,
a stale one removed first) and renames it into place, so a reader sees the old or the
new file, never a torn one, and a FIFO planted at the temporary name cannot block the
writer. The progress line is the one exception to the rename: it is rewritten in place
(``pwrite`` through a descriptor opened ``O_NOFOLLOW | O_NONBLOCK`` and checked to be a
regular file), for a worker reports it every half second.

Torch-free; below :mod:`slurm_elastic.notice` and :mod:`slurm_elastic.live`.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from slurm_elastic.envvars import NODE_DIR_ENV
from slurm_elastic.privatefs import ensure_private_dir, read_regular, replace_file

__all__ = [
    "IGNORED_WARNING_INTERVAL_S",
    "NODE_DIR_ENV",
    "NodeChannel",
    "NodeFile",
    "file_present",
    "read_node_file",
    "remove_node_file",
    "warn_ignored",
    "write_node_file",
]

log = logging.getLogger(__name__)

NOTICE = "notice"
PROGRESS = "progress"
WORKER_PREFIX = "worker."
ASSIGN_PREFIX = "assign."
CLOSED_PREFIX = "closed."
RESTART_PREFIX = "restart."


@dataclass(frozen=True)
class NodeChannel:
    """The files of one node's channel.

    Args:
        directory: the agent's node directory (``$SLURM_ELASTIC_NODE_DIR`` of its workers).
    """

    directory: Path

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> NodeChannel | None:
        """The channel this worker's agent gave it; ``None`` when not started by an agent."""
        value = (os.environ if environ is None else environ).get(NODE_DIR_ENV)
        return cls(Path(value)) if value else None

    def environment(self) -> dict[str, str]:
        """What the agent adds to its workers' environment for the channel."""
        return {NODE_DIR_ENV: str(self.directory)}

    @property
    def notice(self) -> Path:
        """The notice file: its existence means "checkpoint and leave"."""
        return self.directory / NOTICE

    @property
    def progress(self) -> Path:
        """The workers' progress line (the hang watchdog reads it)."""
        return self.directory / PROGRESS

    def registration(self, local_rank: int) -> Path:
        """Worker ``local_rank``'s registration."""
        return self.directory / f"{WORKER_PREFIX}{local_rank}"

    def assignment(self, local_rank: int) -> Path:
        """The agent's newest assignment for worker ``local_rank``."""
        return self.directory / f"{ASSIGN_PREFIX}{local_rank}"

    def closed(self, local_rank: int) -> Path:
        """Worker ``local_rank``'s mark that it finished and closed its session."""
        return self.directory / f"{CLOSED_PREFIX}{local_rank}"

    def restart_path(self, local_rank: int) -> Path:
        """Worker ``local_rank``'s mark that its script takes the restart path."""
        return self.directory / f"{RESTART_PREFIX}{local_rank}"

    def registrations(self) -> list[Path]:
        """The registration files present (any name ``worker.*``: the reader checks it)."""
        try:
            return sorted(p for p in self.directory.iterdir() if p.name.startswith(WORKER_PREFIX))
        except FileNotFoundError:
            return []

    def clear(self) -> None:
        """Remove every message (before workers are (re)started): notice, progress,
        registrations, assignments, closed and restart-path marks and stale temporary files.
        Something that cannot be unlinked at a message's name (a planted directory) is left
        with a warning."""
        try:
            entries = list(self.directory.iterdir())
        except FileNotFoundError:
            return
        for path in entries:
            name = path.name
            prefixes = (WORKER_PREFIX, ASSIGN_PREFIX, CLOSED_PREFIX, RESTART_PREFIX, ".")
            if name in (NOTICE, PROGRESS) or name.startswith(prefixes):
                remove_node_file(path)


def remove_node_file(path: str | os.PathLike[str]) -> None:
    """Unlink ``path`` if present; what cannot be unlinked (a directory) is left with a
    warning (it is no message: every reader refuses it)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        warn_ignored(log, path, f"cannot remove it ({exc.strerror or exc})")


# ---------------------------------------------------------------------------------------
# reading and writing: bounded, non-blocking reads and crash-safe writes

IGNORED_WARNING_INTERVAL_S = 60.0
_WARNED_MAX = 256  # files remembered by the rate limit (a flood of names cannot grow it)
_warned: dict[str, tuple[float, int]] = {}  # path -> (time of the warning, suppressed since)
_warned_lock = threading.Lock()


def warn_ignored(logger: logging.Logger, path: str | os.PathLike[str], reason: str) -> None:
    """Log that a node file was ignored, at most once per file per interval.

    Repeats within :data:`IGNORED_WARNING_INTERVAL_S` go to DEBUG and are counted in the
    next warning: a poll loop meeting the same bad file does not flood the log.

    Args:
        logger: the reader's logger.
        path: the file ignored.
        reason: why, e.g. ``"not a regular file"``.
    """
    key = os.fspath(path)
    now = time.monotonic()
    with _warned_lock:
        last = _warned.get(key)
        if last is not None and now - last[0] < IGNORED_WARNING_INTERVAL_S:
            _warned[key] = (last[0], last[1] + 1)
            logger.debug("ignored %s: %s", key, reason)
            return
        if last is None and len(_warned) >= _WARNED_MAX:
            _warned.pop(next(iter(_warned)))  # the oldest entry
        _warned[key] = (now, 0)
    suppressed = 0 if last is None else last[1]
    if suppressed:
        logger.warning("ignored %s: %s (%d similar warnings suppressed)", key, reason, suppressed)
    else:
        logger.warning("ignored %s: %s", key, reason)


class NodeFile(NamedTuple):
    """What :func:`read_node_file` read.

    Attributes:
        data: the whole content (at most the bound given).
        mtime: the file's modification time (Unix time).
    """

    data: bytes
    mtime: float


def read_node_file(
    path: str | os.PathLike[str], max_bytes: int, logger: logging.Logger
) -> NodeFile | None:
    """Read a small node file without blocking, following a link or reading unbounded.

    Args:
        path: the file.
        max_bytes: a larger file is refused unread.
        logger: where a refusal is reported (:func:`warn_ignored`).

    Returns:
        The content, or ``None`` when the file does not exist or was refused: not a
        regular file (a FIFO, a directory, a device), a symbolic link, larger than
        ``max_bytes``, or not readable.
    """
    try:
        got = read_regular(path, limit=max_bytes)  # no link, no blocking on a FIFO
    except OSError as exc:  # ELOOP: a symbolic link; EACCES; EIO
        if exc.errno == errno.EISDIR:
            why = "not a regular file"
        elif exc.errno == errno.EFBIG:
            why = exc.strerror or "too large"
        else:
            why = f"cannot read it ({exc.strerror or exc})"
        warn_ignored(logger, path, why)
        return None
    if got is None:
        return None
    return NodeFile(got[0], got[1].st_mtime)


def write_node_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (a temporary file, then ``rename``).

    The temporary file (``.<name>.<pid>.tmp`` beside ``path``) is created exclusively
    and without following a link, after removing a stale one: whatever was planted at
    that name (a FIFO, a link) is never opened, so the writer cannot block on it.

    Raises:
        OSError: the directory cannot be written, or the temporary name is taken by
            something that cannot be removed (a directory).
    """
    target = Path(path)
    ensure_private_dir(target.parent)
    replace_file(target, data, tmp=f".{target.name}.{os.getpid()}.tmp", clear_tmp=True)


def file_present(path: str | os.PathLike[str], logger: logging.Logger) -> bool:
    """Whether ``path`` is a regular file (a writer's rename always leaves one; anything
    else at that name is ignored with a warning)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        warn_ignored(logger, path, f"cannot stat it ({exc.strerror or exc})")
        return False
    if not stat.S_ISREG(st.st_mode):
        warn_ignored(logger, path, "not a regular file")
        return False
    return True
