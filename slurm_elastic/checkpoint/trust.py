"""Which checkpoint paths may be trusted, and reading them through held descriptors
(torch-free).

Checkpoint directories live on a shared filesystem. Whoever can write a checkpoint file
can make ``torch.load``/DCP unpickle what they like, and CRC32s in a manifest they can also
rewrite prove nothing. So: every directory we create is ``0700`` whatever the umask or a
setgid parent (each missing parent included: :mod:`slurm_elastic.privatefs` creates
them), and we read only from directories and files
that are owned by this user and not writable by the group or others (symbolic links
inside a checkpoint are refused). The errors name the path, the owner/mode found, and the
fix.

Checks and reads go through held descriptors (:class:`CheckedDir`): a directory is opened
(``O_DIRECTORY``, ``O_NOFOLLOW`` below the checkpoint root), checked with ``fstat``, and
everything inside it is opened relative to that descriptor (``openat`` with
``O_NOFOLLOW``) and checked with ``fstat`` again. What was checked is what is read: a
neighbour who renames directories between the check and the read (``renameat2`` with
``RENAME_EXCHANGE`` in a group-writable parent) cannot change it. Readers that only take
a path (DCP) are given ``/proc/self/fd/<fd>`` of the held directory.

Errors (all :class:`~slurm_elastic.errors.CheckpointError`)::

    UntrustedCheckpointError   another owner, group/other-writable, a link, a special file
    ForeignRunError            the directory holds another run's checkpoints
    CheckpointReadError        the node or the filesystem failed (I/O, memory, device):
                               not damage; every checkpoint is left in place

Only our own format's evidence (a size, a CRC32, a parse of our header or manifest) makes
a checkpoint damaged (:class:`~slurm_elastic.errors.CheckpointCorruptError`).
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from slurm_elastic.envvars import RUN_ID_ENV
from slurm_elastic.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointReadError,
    ForeignRunError,
    UnsafeDirectoryError,
    UntrustedCheckpointError,
)
from slurm_elastic.privatefs import ensure_private_dir

__all__ = [
    "CheckedDir",
    "CheckpointReadError",
    "ForeignRunError",
    "UntrustedCheckpointError",
    "check_fd",
    "check_private",
    "check_run",
    "make_private_dir",
    "open_data_file",
    "read_error",
]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted where a file should be must not block the open.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


_HINTS = {
    errno.ENOMEM: "out of memory: free memory on this node (or load with mmap=True)",
    errno.EIO: "an I/O error from the filesystem or the disk: check the storage (dmesg) and retry",
    errno.EACCES: "permission denied: make the checkpoint readable by this user",
    errno.EPERM: "operation not permitted: make the checkpoint readable by this user",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n)",
    errno.ENFILE: "too many open files on this node: retry later",
    errno.ESTALE: "a stale file handle (NFS): retry",
    errno.ETIMEDOUT: "the filesystem timed out: retry when it answers",
}


def read_error(exc: BaseException, what: str) -> CheckpointError:
    """Classify an error raised while reading ``what`` (no checkpoint is ever damaged by it).

    A missing file is our format's evidence of damage (the manifest names it):
    :class:`~slurm_elastic.errors.CheckpointCorruptError`. Any other ``OSError`` and a
    ``MemoryError`` are the environment's: :class:`CheckpointReadError`, with a hint.
    """
    if isinstance(exc, FileNotFoundError):
        return CheckpointCorruptError(f"{what} is missing ({exc}); the checkpoint is incomplete")
    if isinstance(exc, MemoryError):
        hint = "out of memory: free memory on this node (or load with mmap=True)"
    elif isinstance(exc, OSError) and exc.errno in _HINTS:
        hint = _HINTS[exc.errno]
    elif isinstance(exc, OSError) and exc.errno:
        hint = os.strerror(exc.errno)
    else:
        hint = f"{type(exc).__name__}: {exc}"
    return CheckpointReadError(
        f"cannot read {what} on {socket.gethostname()}: {hint} ({type(exc).__name__}: {exc}). "
        "This is an error of the node or the filesystem, not damage: every checkpoint was "
        "left in place; fix the cause and load again"
    )


def _describe_loop(path: Path, exc: OSError) -> CheckpointError:
    return CheckpointError(
        f"checkpoint directory {path} cannot be resolved: a symbolic link loop ({exc}); "
        "point the checkpoint directory at a real directory"
    )


def _check_stat(st: os.stat_result, path: Path, *, directory: bool) -> None:
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        what = "a directory" if directory else "a regular file"
        raise UntrustedCheckpointError(
            f"checkpoint path {path} is not {what} (mode {stat.filemode(st.st_mode)}); "
            "refusing to read it: links and special files are never loaded"
        )
    uid = os.geteuid()
    if st.st_uid != uid:
        raise UntrustedCheckpointError(
            f"checkpoint path {path} is owned by uid {st.st_uid}, not by this user "
            f"(uid {uid}); refusing to read it (another user could have planted code). "
            "Load only checkpoints you wrote, or copy them into a directory you own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedCheckpointError(
            f"checkpoint path {path} is writable by others (mode "
            f"{stat.filemode(st.st_mode)}); refusing to read it. If you trust its "
            f"content, run: chmod go-w {path}"
        )


def check_fd(fd: int, path: Path, *, directory: bool) -> os.stat_result:
    """Check the open ``fd`` (opened by ``path``) like :func:`check_private`; return its
    ``stat``.

    Raises:
        UntrustedCheckpointError: another owner, group/other-writable, wrong type.
    """
    st = os.fstat(fd)
    _check_stat(st, path, directory=directory)
    return st


def check_private(path: Path, *, directory: bool, follow: bool = False) -> os.stat_result:
    """Check that ``path`` is ours and not writable by others; return its ``stat``.

    A check by path: prefer :class:`CheckedDir`, which checks what it then reads.

    Args:
        path: the file or directory.
        directory: whether it must be a directory (else a regular file).
        follow: follow a symbolic link at ``path`` itself (only for the checkpoint root,
            which a user may point elsewhere); links inside a checkpoint are refused.

    Raises:
        UntrustedCheckpointError: another owner, group/other-writable, a link, wrong type.
        CheckpointError: a symbolic link loop.
        FileNotFoundError: ``path`` does not exist.
    """
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _describe_loop(path, exc) from exc
        raise
    _check_stat(st, path, directory=directory)
    return st


def _open_error(exc: OSError, path: Path, *, directory: bool, follow: bool) -> BaseException:
    """The error to raise for a failed (no-follow) open of ``path``."""
    if exc.errno == errno.ELOOP and follow:
        return _describe_loop(path, exc)
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO, errno.EOPNOTSUPP):
        what = "a directory" if directory else "a regular file"
        return UntrustedCheckpointError(
            f"checkpoint path {path} is not {what} (a symbolic link or a special file: "
            f"{exc.strerror}); refusing to read it: links and special files are never loaded"
        )
    return exc


class CheckedDir:
    """A directory held open and checked (ours, not writable by others).

    Everything inside is opened relative to the held descriptor, without following links,
    and checked again with ``fstat`` (:meth:`open_file`, :meth:`open_dir`), so a rename of
    any path component after the check cannot change what is read. Close it (or use it as
    a context manager).

    Attributes:
        fd: the held descriptor.
        path: the path it was opened by (for messages only).
    """

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, follow: bool = True) -> CheckedDir:
        """Open and check the directory ``path``.

        Args:
            path: the directory.
            follow: follow a symbolic link at ``path`` itself (the checkpoint root only,
                which a user may point elsewhere).

        Raises:
            FileNotFoundError: it does not exist.
            UntrustedCheckpointError: not ours, writable by others, a link (``follow``
                false) or not a directory.
            CheckpointError: a symbolic link loop.
            OSError: it cannot be opened (I/O, permission, too many open files).
        """
        path = Path(path)
        flags = _DIR_FLAGS | (0 if follow else os.O_NOFOLLOW)
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            raise _open_error(exc, path, directory=True, follow=follow) from exc
        return cls._checked(fd, path, directory=True)

    @classmethod
    def _checked(cls, fd: int, path: Path, *, directory: bool) -> CheckedDir:
        try:
            _check_stat(os.fstat(fd), path, directory=directory)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path)

    def open_dir(self, name: str) -> CheckedDir:
        """Open and check the directory ``name`` inside this one (never through a link).

        Raises:
            FileNotFoundError: it does not exist.
            UntrustedCheckpointError: not ours, writable by others, a link, not a directory.
            OSError: it cannot be opened.
        """
        path = self.path / name
        try:
            fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=self.fd)
        except OSError as exc:
            raise _open_error(exc, path, directory=True, follow=False) from exc
        return self._checked(fd, path, directory=True)

    def open_file(self, name: str) -> int:
        """Open the regular file ``name`` inside this one for reading (never through a
        link), check it, and return its descriptor (the caller closes it).

        Raises:
            FileNotFoundError: it does not exist.
            UntrustedCheckpointError: not ours, writable by others, a link or special file.
            OSError: it cannot be opened.
        """
        path = self.path / name
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=self.fd)
        except OSError as exc:
            raise _open_error(exc, path, directory=False, follow=False) from exc
        try:
            _check_stat(os.fstat(fd), path, directory=False)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def lstat(self, name: str) -> os.stat_result:
        """``lstat`` of ``name`` inside this directory (a link is not followed)."""
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def names(self) -> list[str]:
        """The entries of this directory (read through the held descriptor)."""
        return os.listdir(self.fd)

    def mkdir(self, name: str) -> None:
        """Create the directory ``name`` inside this one, ``0700`` exactly (no umask, no
        inherited ``S_ISGID``).

        Raises:
            OSError: it cannot be created (the error names the whole path).
        """
        try:
            os.mkdir(name, 0o700, dir_fd=self.fd)
            fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=self.fd)
        except OSError as exc:  # name the whole path in the caller's message
            raise OSError(exc.errno, exc.strerror, str(self.path / name)) from exc
        try:
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)

    def rename(self, old: str, new: str) -> None:
        """Rename ``old`` to ``new`` inside this directory (links are renamed, not followed)."""
        os.rename(old, new, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def sync(self) -> None:
        """fsync this directory (renames and creations in it become durable)."""
        os.fsync(self.fd)

    def remove(self, name: str, *, after_first: Callable[[], None] | None = None) -> None:
        """Remove ``name`` inside this directory, never following a link.

        A link (or any non-directory) is unlinked: the name goes, its target is not
        touched. A directory is emptied through its own descriptor, then removed;
        ``after_first`` is called after its first entry is gone (a crash point for tests).

        Raises:
            FileNotFoundError: ``name`` is gone.
            OSError: it cannot be removed.
        """
        _remove_at(self.fd, name, after_first)

    def newest_mtime(self, name: str) -> float:
        """The newest modification time of ``name`` and (a directory's) entries in it."""
        newest = self.lstat(name).st_mtime
        try:
            fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=self.fd)
        except OSError:
            return newest  # a link or a file: its own time only
        try:
            with os.scandir(fd) as it:
                for entry in it:
                    try:
                        newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
                    except FileNotFoundError:
                        continue
        finally:
            os.close(fd)
        return newest

    @property
    def proc_path(self) -> Path:
        """``/proc/self/fd/<fd>``: this very directory, for readers that take only a path
        (valid while it is held, in this process)."""
        return Path(f"/proc/self/fd/{self.fd}")

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> CheckedDir:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _remove_at(dir_fd: int, name: str, after_first: Callable[[], None] | None) -> None:
    try:
        fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            os.unlink(name, dir_fd=dir_fd)  # a link or a file: never followed
            return
        raise
    try:
        with os.scandir(fd) as it:
            entries = sorted(it, key=lambda e: e.name)
        for n, entry in enumerate(entries):
            if entry.is_dir(follow_symlinks=False):
                _remove_at(fd, entry.name, None)
            else:
                os.unlink(entry.name, dir_fd=fd)
            if n == 0 and after_first is not None:
                after_first()
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def check_run(
    found: str | None, ours: str | None, path: Path, directory: Path, action: str
) -> None:
    """Refuse a checkpoint of run ``found`` in run ``ours`` (``None`` on either side: no
    run recorded, or no run here: accepted).

    Raises:
        ForeignRunError: naming both runs, the path and the fix.
    """
    if found is None or ours is None or found == ours:
        return
    raise ForeignRunError(
        f"checkpoint {path} belongs to run {found!r}, but this is run {ours!r}: refusing to "
        f"{action} in another run's checkpoint directory ({directory}; swapped or "
        f"mis-pointed). Point run {ours!r} at its own checkpoint directory; to continue run "
        f"{found!r} on purpose, give this run the same run id (${RUN_ID_ENV}, run_id in the "
        "config, or CheckpointManager(run_id=...))"
    )


def make_private_dir(path: Path) -> None:
    """Create ``path`` and each missing parent ``0700`` (whatever the umask or a setgid
    parent), or check an existing one.

    Creation is the shared private-filesystem layer's
    (:func:`slurm_elastic.privatefs.ensure_private_dir`: every directory it creates is
    ``fchmod``-ed to ``0700`` exactly, ``S_ISGID`` cleared, through no-follow descriptors).
    Existing parents are left as they are (they may be shared: ``/scratch``). An existing
    ``path`` may be a symbolic link to the user's real checkpoint directory.

    Raises:
        UntrustedCheckpointError: it exists but is not ours or is writable by others, or
            something on the way to create it is a link or not ours.
        CheckpointError: a symbolic link loop, or it exists and is not a directory.
        OSError: it cannot be created (the caller words ENOSPC/EACCES/EROFS).
    """
    try:
        os.stat(path)
    except FileNotFoundError:
        try:
            ensure_private_dir(path)
        except UnsafeDirectoryError as exc:
            raise UntrustedCheckpointError(
                f"cannot create the checkpoint directory {path} safely: {exc}"
            ) from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _describe_loop(path, exc) from exc
        raise
    check_private(path, directory=True, follow=True)


def open_data_file(path: Path, at: CheckedDir | None) -> int:
    """Open checkpoint file ``path`` for reading: through the held directory ``at`` when
    given (checked on the open descriptor), else by path without following a link and
    checked after the open. Return the descriptor (the caller closes it).

    Raises:
        CheckpointCorruptError: it is missing (the manifest names it: damage).
        UntrustedCheckpointError: not ours, writable by others, a link or not a file.
        CheckpointReadError: the node or the filesystem failed the open.
    """
    try:
        fd = at.open_file(path.name) if at is not None else os.open(path, _FILE_FLAGS)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"checkpoint file {path} is missing ({exc})") from exc
    except CheckpointError:
        raise
    except OSError as exc:
        raise read_error(exc, f"checkpoint file {path}") from exc
    if at is None:  # opened by path: the file itself must still be ours and private
        try:
            check_fd(fd, path, directory=False)
        except BaseException:
            os.close(fd)
            raise
    return fd
