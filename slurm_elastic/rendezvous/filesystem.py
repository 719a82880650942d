"""The few filesystem operations the rendezvous relies on, made safe and countable.

Everything the rendezvous does on the shared filesystem goes through this module, so
the set of primitives is small and reviewable (see ``docs/rendezvous.md``):

* ``mkdir`` (exclusive by nature) and ``rename`` of a freshly built directory,
* ``open(O_CREAT | O_EXCL | O_NOFOLLOW)`` of private temporary files,
* ``link(tmp, name)``: an *exclusive*, atomic publication of an immutable file,
* ``rename(tmp, name)``: an atomic replacement of a small pointer file,
* ``unlink``, ``listdir`` and ``open`` for reading.

No ``flock``/``fcntl`` lock is ever taken: a process that dies at any point leaves at
worst an orphaned temporary file, never a lock that blocks the job.

Security: :func:`ensure_private_dir` refuses a directory that is a symlink, is owned by
another user, or is writable by group/others (the state is read by unpickling), and
creates missing directories ``0700``. Files are created ``0600`` with ``O_NOFOLLOW``.

:data:`FS_OPS` counts the metadata operations of this process (``open``, ``stat``,
``link``, ``rename``, ``unlink``, ``mkdir``, ``listdir``) for the benchmark.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import socket
import stat
import threading
from collections import Counter
from pathlib import Path

from slurm_elastic.errors import RendezvousSetupError

__all__ = [
    "FS_OPS",
    "FsOps",
    "ensure_private_dir",
    "link_exclusive",
    "listdir",
    "read_small",
    "remove",
    "replace_file",
    "tmp_name",
    "write_in_place",
]


class FsOps:
    """A thread-safe counter of metadata operations, by kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, kind: str, n: int = 1) -> None:
        """Count ``n`` operations of ``kind``."""
        with self._lock:
            self._counts[kind] += n

    def snapshot(self) -> dict[str, int]:
        """Return a copy of the counts (kind -> number)."""
        with self._lock:
            return dict(self._counts)

    def total(self) -> int:
        """Return the number of operations counted so far."""
        with self._lock:
            return sum(self._counts.values())

    def reset(self) -> None:
        """Forget all counts."""
        with self._lock:
            self._counts.clear()


#: Metadata operations done by this process's rendezvous code.
FS_OPS = FsOps()

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def ensure_private_dir(path: Path, *, create: bool = True) -> Path:
    """Make sure ``path`` is a directory only the current user can write to.

    Args:
        path: the directory.
        create: create it (mode ``0700``, parents as needed) when missing.

    Returns:
        ``path``.

    Raises:
        RendezvousSetupError: the path is a symlink or not a directory, is owned by
            another user, or is writable by group or others.
    """
    FS_OPS.add("stat")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            raise RendezvousSetupError(
                f"rendezvous directory {str(path)!r} does not exist; create it on the "
                "shared filesystem or point the endpoint at an existing one"
            ) from None
        try:
            FS_OPS.add("mkdir")
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise RendezvousSetupError(
                f"cannot create rendezvous directory {str(path)!r}: {exc}; choose a "
                "writable directory on the shared filesystem"
            ) from exc
        FS_OPS.add("stat")
        st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise RendezvousSetupError(
            f"rendezvous directory {str(path)!r} is a symlink; refusing to follow it "
            "(someone could redirect the state). Use the real path instead"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise RendezvousSetupError(
            f"rendezvous path {str(path)!r} is not a directory; remove it or choose another path"
        )
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise RendezvousSetupError(
            f"rendezvous directory {str(path)!r} is owned by uid {st.st_uid}, not by you "
            f"(uid {os.getuid()}); the state is unpickled, so only your own directory is "
            "safe. Use a directory you own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RendezvousSetupError(
            f"rendezvous directory {str(path)!r} has mode {stat.S_IMODE(st.st_mode):04o}, "
            "writable by group/others; the state is unpickled, so this allows code "
            f"execution. Fix: chmod go-w {str(path)!r}"
        )
    return path


def tmp_name(directory: Path, stem: str) -> Path:
    """Return a unique temporary path in ``directory`` (host, pid and random suffix)."""
    host = socket.gethostname().split(".")[0] or "host"
    return directory / f".tmp.{stem}.{host}.{os.getpid()}.{secrets.token_hex(4)}"


def _write_new(path: Path, data: bytes, *, fsync: bool) -> None:
    FS_OPS.add("open")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def link_exclusive(directory: Path, name: str, data: bytes, *, fsync: bool = True) -> bool:
    """Publish ``data`` as ``directory/name`` only if that name does not exist yet.

    The content is written to a private temporary file first and then hard-linked to
    its final name: ``link(2)`` fails with ``EEXIST`` when the name exists, on every
    POSIX filesystem including NFS and Lustre, and the file appears with its full
    content (readers never see a partial file).

    Returns:
        True when this call created the name; False when it existed already.

    Raises:
        OSError: any other filesystem error.
    """
    tmp = tmp_name(directory, name)
    _write_new(tmp, data, fsync=fsync)
    target = directory / name
    try:
        FS_OPS.add("link")
        os.link(tmp, target)
        return True
    except FileExistsError:
        # An NFS retransmission can report EEXIST for a link that did succeed: the
        # classic check is whether the target is our inode.
        try:
            FS_OPS.add("stat")
            return os.stat(tmp).st_nlink == 2
        except OSError:
            return False
    finally:
        FS_OPS.add("unlink")
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def replace_file(directory: Path, name: str, data: bytes, *, fsync: bool = False) -> None:
    """Atomically replace ``directory/name`` with ``data`` (temporary file + rename)."""
    tmp = tmp_name(directory, name)
    _write_new(tmp, data, fsync=fsync)
    try:
        FS_OPS.add("rename")
        os.replace(tmp, directory / name)
    except OSError:
        FS_OPS.add("unlink")
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_in_place(path: Path, data: bytes) -> None:
    """Overwrite the start of ``path`` with ``data``, creating it ``0600`` if missing.

    Used for heartbeat counters: the file keeps its inode, so a writer costs one
    ``open`` per update whatever the number of nodes. Closing the file flushes it to
    the server on NFS (close-to-open consistency).
    """
    FS_OPS.add("open")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o600)
    try:
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)


def read_small(path: Path, limit: int = 64 << 20) -> bytes | None:
    """Return the content of ``path`` (not following a symlink), or None if missing.

    Raises:
        OSError: the file exists but cannot be read (``ELOOP`` for a planted symlink).
    """
    FS_OPS.add("open")
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise OSError(errno.EFBIG, f"{path} is larger than {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def listdir(directory: Path) -> list[str]:
    """Return the names in ``directory`` (empty when it does not exist)."""
    FS_OPS.add("listdir")
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


def remove(path: Path) -> None:
    """Unlink ``path``, ignoring a missing file."""
    FS_OPS.add("unlink")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
