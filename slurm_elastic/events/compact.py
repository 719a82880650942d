"""Bounded event directories: the files of a node's processes that are gone, merged.

Each process writes its own file (``<host>.<pid>.jsonl``, :mod:`.writer`), so a long
preemptible job whose workers are restarted at every change would leave one file per
process it ever started. The agent, before each start of its workers (its first one
included) and at each in-place re-formation, calls :func:`compact`: the files of *its own node's* processes that no longer run are appended
to that node's archive, ``<host>.archive.jsonl``, and removed. The directory then holds
one archive per node plus one file per live process, whatever the number of changes.

Only a process's own node can tell whether it still runs (``/proc/<pid>``; the agent and
its workers share the node's process table), so an agent merges files of its own host
name only. A pid that runs again (another process) keeps its file until a later pass.

Crash safety, without rewriting the archive: under a per-node lock (``.<host>.lock`` in
the directory, a POSIX record lock; where the filesystem has none, nothing is merged),
each gone process's complete lines are appended to the archive, the archive
is flushed to disk, and only then is the file removed. A crash before the removal leaves
the file, merged again by the next pass: its lines then appear twice, and
:func:`~slurm_elastic.events.reader.read_events` drops a record it has already read. A
crash inside the append leaves a torn line, ended by the next append (read as one
malformed line, skipped with a warning); the lines themselves are still in the file.
A torn last line of a gone process (killed mid-write) is not merged. Files are opened
without following links and must be regular files (the directory is private, but lies on
a shared filesystem).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

from slurm_elastic import procstat
from slurm_elastic.envvars import EVENTS_DIR_ENV
from slurm_elastic.errors import UnsafeDirectoryError
from slurm_elastic.events.schema import current_host
from slurm_elastic.privatefs import READ_FLAGS, ensure_private_dir, open_writable

__all__ = ["ARCHIVE", "compact"]

log = logging.getLogger(__name__)

#: The archive of a node's gone processes: ``<host>.archive.jsonl``.
ARCHIVE = "archive"
_PROCESS_FILE = re.compile(r"^(?P<host>.+)\.(?P<pid>\d+)\.jsonl$")
_CHUNK = 1 << 20


def _gone(pid: int) -> bool:
    return procstat.read(pid) is None


def compact(
    directory: str | os.PathLike[str] | None = None, *, host: str | None = None
) -> list[Path]:
    """Merge the event files of this node's gone processes into its archive.

    Best effort, never raises (observability must not take training down): what cannot be
    merged stays as it is, logged at DEBUG.

    Args:
        directory: the events directory (default: ``$SLURM_ELASTIC_EVENTS_DIR``; none: no-op).
        host: this node's name as the writers record it (default: :func:`current_host`).

    Returns:
        The files merged and removed.
    """
    where = directory if directory is not None else os.environ.get(EVENTS_DIR_ENV)
    if not where:
        return []
    base = Path(where)
    node = host if host is not None else current_host()
    try:
        ensure_private_dir(base)  # ours, 0700, not a link: the writers' own check
        with _node_lock(base, node) as locked:
            if not locked:
                return []
            return _merge(base, node)
    except (OSError, UnsafeDirectoryError) as exc:
        log.debug("not compacting the events in %s: %s", base, exc)
        return []


@contextlib.contextmanager
def _node_lock(base: Path, node: str) -> Iterator[bool]:
    """Hold this node's compaction lock (non-blocking): True if held."""
    fd = open_writable(base / f".{node}.lock", read=True)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.ENOLCK, errno.EOPNOTSUPP):
                raise
            log.debug("events of %s: compaction lock not taken (%s)", node, exc.strerror)
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _merge(base: Path, node: str) -> list[Path]:
    own = os.getpid()
    victims = []
    for name in sorted(os.listdir(base)):
        match = _PROCESS_FILE.match(name)
        if match is None or match["host"] != node:
            continue
        pid = int(match["pid"])
        if pid != own and _gone(pid):
            victims.append(base / name)
    if not victims:
        return []
    merged: list[Path] = []
    try:
        archive = open_writable(base / f"{node}.{ARCHIVE}.jsonl", append=True, read=True)
    except OSError as exc:
        log.debug("events archive of %s: not compacting (%s)", node, exc)
        return []
    try:
        _end_torn_line(archive)
        for path in victims:
            try:
                copied = _append_complete_lines(path, archive)
            except OSError as exc:
                log.debug("not merging %s: %s", path, exc)
                continue
            if copied is None:
                continue
            os.fsync(archive)  # on disk before the source goes
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            merged.append(path)
    finally:
        os.close(archive)
    if merged:
        log.debug("merged %d event files of gone processes into the archive", len(merged))
    return merged


def _end_torn_line(fd: int) -> None:
    """End a line a crashed append left open, so the next record starts a line."""
    size = os.fstat(fd).st_size
    if size and os.pread(fd, 1, size - 1) != b"\n":
        os.write(fd, b"\n")


def _append_complete_lines(path: Path, archive: int) -> int | None:
    """Append ``path``'s bytes up to its last newline to ``archive``; return how many.

    None (nothing appended) if ``path`` is not a regular file.
    """
    fd = os.open(path, READ_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            log.debug("not merging %s: not a regular file", path)
            return None
        end = _after_last_newline(fd)
        pos = 0
        while pos < end:
            chunk = os.pread(fd, min(_CHUNK, end - pos), pos)
            if not chunk:
                break
            os.write(archive, chunk)  # O_APPEND: at the end
            pos += len(chunk)
        return pos
    finally:
        os.close(fd)


def _after_last_newline(fd: int) -> int:
    """The offset just after the file's last newline (0: none)."""
    end = os.fstat(fd).st_size
    while end > 0:
        start = max(0, end - _CHUNK)
        at = os.pread(fd, end - start, start).rfind(b"\n")
        if at >= 0:
            return start + at + 1
        end = start
    return 0
