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

Checks and reads go through held descriptors (:class:`CheckpointDir`, the shared
private-filesystem layer's :class:`~slurm_elastic.privatefs.SafeDir` with this package's
errors): a directory is opened (``O_DIRECTORY``, ``O_NOFOLLOW`` below the checkpoint
root), checked with ``fstat``, and everything inside it is opened relative to that
descriptor (``openat`` with ``O_NOFOLLOW``) and checked with ``fstat`` again. What was checked is what is read: a
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
from pathlib import Path

from slurm_elastic.envvars import RUN_ID_ENV
from slurm_elastic.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointReadError,
    ForeignRunError,
    UnsafeDirectoryError,
    UntrustedCheckpointError,
)
from slurm_elastic.privatefs import SafeDir, ensure_private_dir

__all__ = [
    "CheckpointDir",
    "CheckpointReadError",
    "ForeignRunError",
    "UntrustedCheckpointError",
    "check_run",
    "make_private_dir",
    "open_data_file",
    "read_error",
]

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


class CheckpointDir(SafeDir):
    """A checkpoint directory held open and checked (ours, not writable by others).

    Everything inside is opened relative to the held descriptor, without following links,
    and checked again with ``fstat`` (:meth:`open_file`, :meth:`subdir`), so a rename of
    any path component after the check cannot change what is read. Close it (or use it
    as a context manager). Unsafe paths raise :class:`UntrustedCheckpointError`.
    """

    @classmethod
    def _refuse(cls, problem: str) -> Exception:
        return UntrustedCheckpointError(
            f"checkpoint path {problem} (refusing to read it: another user could have "
            "planted code; use only checkpoints you wrote, or copy them into a directory "
            "you own)"
        )

    def open_dir(self, name: str) -> CheckpointDir:
        """Open and check the directory ``name`` inside this one (never through a link).

        Raises:
            FileNotFoundError: it does not exist.
            UntrustedCheckpointError: not ours, writable by others, a link, not a directory.
            OSError: it cannot be opened.
        """
        return self.subdir(name, create=False)

    @classmethod
    def _missing(cls, path: str) -> Exception:
        return FileNotFoundError(errno.ENOENT, "no such checkpoint directory", path)

    @classmethod
    def _failed(cls, path: str, exc: OSError, doing: str) -> Exception:
        return OSError(exc.errno, exc.strerror, path)  # the caller words it (read_error)


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
    parent), or check an existing one, through held descriptors (the shared layer's
    :func:`~slurm_elastic.privatefs.ensure_private_dir` and :meth:`CheckpointDir.open_checked`).

    Existing parents are left as they are (they may be shared: ``/scratch``). An existing
    ``path`` may be a symbolic link to the user's real checkpoint directory.

    Raises:
        UntrustedCheckpointError: it exists but is not ours, is writable by others or is
            not a directory, is a symbolic link loop, or something on the way to create
            it is a link or not ours.
        OSError: it cannot be created (the caller words ENOSPC/EACCES/EROFS).
    """
    try:
        CheckpointDir.open_checked(path, follow=True).close()
    except FileNotFoundError:
        try:
            ensure_private_dir(path)
        except UnsafeDirectoryError as exc:
            raise UntrustedCheckpointError(
                f"cannot create the checkpoint directory {path} safely: {exc}"
            ) from exc


def open_data_file(path: Path, at: CheckpointDir | None) -> int:
    """Open checkpoint file ``path`` for reading through the held directory ``at`` (by
    default its directory, opened and checked now), checked on the open descriptor.
    Return the descriptor (the caller closes it).

    Raises:
        CheckpointCorruptError: it is missing (the manifest names it: damage).
        UntrustedCheckpointError: not ours, writable by others, a link or not a file.
        CheckpointReadError: the node or the filesystem failed the open.
    """
    try:
        if at is not None:
            return at.open_file(path.name)
        with CheckpointDir.open_checked(path.parent, follow=True) as parent:
            return parent.open_file(path.name)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"checkpoint file {path} is missing ({exc})") from exc
    except CheckpointError:
        raise
    except OSError as exc:
        raise read_error(exc, f"checkpoint file {path}") from exc
