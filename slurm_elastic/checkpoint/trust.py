"""Which checkpoint paths may be trusted (torch-free).

Checkpoint directories live on a shared filesystem. Whoever can write a checkpoint file
can make ``torch.load``/DCP unpickle what they like, and CRC32s in a manifest they can also
rewrite prove nothing. So: directories we create are ``0700`` whatever the umask, and we
read only from directories and files that are owned by this user and not writable by the
group or others (symbolic links inside a checkpoint are refused). The errors name the path,
the owner/mode found, and the fix.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from slurm_elastic.errors import CheckpointError

__all__ = ["UntrustedCheckpointError", "check_private", "make_private_dir"]


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint path is owned by another user or writable by others: never read."""


def _describe_loop(path: Path, exc: OSError) -> CheckpointError:
    return CheckpointError(
        f"checkpoint directory {path} cannot be resolved: a symbolic link loop ({exc}); "
        "point the checkpoint directory at a real directory"
    )


def check_private(path: Path, *, directory: bool, follow: bool = False) -> os.stat_result:
    """Check that ``path`` is ours and not writable by others; return its ``stat``.

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
    return st


def make_private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) with the leaf ``0700``, or check an existing one.

    Raises:
        UntrustedCheckpointError: it exists but is not ours or is writable by others.
        CheckpointError: a symbolic link loop, or it exists and is not a directory.
        OSError: it cannot be created (the caller words ENOSPC/EACCES/EROFS).
    """
    try:
        os.stat(path)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass  # created concurrently: checked below
        else:
            os.chmod(path, 0o700)  # exact, whatever the umask
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _describe_loop(path, exc) from exc
        raise
    check_private(path, directory=True, follow=True)
