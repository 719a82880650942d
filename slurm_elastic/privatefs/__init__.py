"""The private-filesystem layer: every private-path check and atomic write of the package
(torch-free, Slurm-free, low in the layers).

Every directory slurm_elastic creates (the state directory and, below it, the rendezvous,
checkpoints, events, logs; the node channel directory, the run index, the run keys) and
every file it reads or writes there goes through this package:

* :class:`SafeDir` (:mod:`~slurm_elastic.privatefs.safedir`): a directory held open and
  checked; everything inside is opened relative to its descriptor without following a
  link, and checked with ``fstat`` (owned by this user, not writable by group/others).
  The walk down a path (:meth:`SafeDir.open_tree`) creates what is missing ``0700``
  *exactly*. The rendezvous (``RendezvousDir``) and the checkpoints (``CheckpointDir``)
  subclass it to word their errors; :func:`refusal` is the one check;
* :func:`ensure_private_dir`: that walk, for a directory that must exist (checked from
  the product tree's ``root`` down), remembered per process;
* the file primitives (:mod:`~slurm_elastic.privatefs.files`): :func:`read_regular`,
  :func:`write_new`, :func:`replace_file` (atomic, optionally fsynced),
  :func:`publish_exclusive` (first writer wins), :func:`create_new` (a streaming
  writer's new file) and :func:`open_writable` (a progress line, an event log);
  :data:`READ_FLAGS` for readers that stream.

Directories above ``root`` (a home or project directory) are the user's business: they
are resolved by the OS and may be shared (a group member who can rename entries there
can only exchange whole trees of ours, never make us use a directory we do not own).
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

from slurm_elastic.privatefs.checks import refusal
from slurm_elastic.privatefs.files import (
    READ_FLAGS,
    create_new,
    open_writable,
    publish_exclusive,
    read_regular,
    replace_file,
    write_new,
)
from slurm_elastic.privatefs.ops import FS_OPS, FsOps
from slurm_elastic.privatefs.safedir import DIR_FLAGS, SafeDir

__all__ = [
    "DIR_FLAGS",
    "FS_OPS",
    "READ_FLAGS",
    "FsOps",
    "SafeDir",
    "create_new",
    "ensure_private_dir",
    "is_private",
    "open_writable",
    "private_tree",
    "publish_exclusive",
    "read_regular",
    "refusal",
    "replace_file",
    "write_new",
]

_ensured: set[tuple[str, str]] = set()
_lock = threading.Lock()


def is_private(st: os.stat_result) -> bool:
    """Whether ``st`` is a directory of this user that nobody else may write into."""
    return refusal("", st) is None


def ensure_private_dir(
    path: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None
) -> Path:
    """Create ``path`` and its missing parents ``0700``, or check the existing ones
    (:meth:`SafeDir.open_tree` with ``root`` as the anchor, no sticky exception).

    Args:
        path: the directory (made absolute, never resolved through links below ``root``).
        root: the top of the product's own tree that ``path`` lies in (e.g. the state
            directory for its ``checkpoints/<run>``); every component from ``root`` down
            is checked. Default: ``path`` itself (only it and what is created is ours).

    Returns:
        The absolute path.

    Raises:
        UnsafeDirectoryError: a component from ``root`` down is a link, not a directory,
            not ours, or writable by group/others (the message says the fix).
        OSError: a directory cannot be created (EACCES, EROFS, ENOSPC...).
        ValueError: ``root`` is not ``path`` or an ancestor of it.
    """
    target = Path(os.path.abspath(path))
    top = Path(os.path.abspath(root)) if root is not None else target
    if top != target and top not in target.parents:
        raise ValueError(f"root {top} is not {target} or an ancestor of it")
    key = (str(target), str(top))
    with _lock:
        known = key in _ensured
    if known:  # walked before: one lstat tells it is still there and still ours
        try:
            if is_private(os.lstat(target)):
                return target
        except OSError:
            pass
        with _lock:
            _ensured.discard(key)
    SafeDir.open_tree(target, anchor=top, sticky_ok=False).close()
    with _lock:
        _ensured.add(key)
    return target


def private_tree(path: Path) -> None:
    """Make every directory of ours below ``path`` (``path`` included) ``0700``.

    For directories a library creates with the umask inside one of ours (torch's
    per-attempt log directories). Links are not followed; directories of other users are
    left alone (and never entered). Errors are ignored: the parent is private already.
    """

    def walk(fd: int) -> None:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            return
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
        for entry in os.scandir(fd):
            if entry.is_dir(follow_symlinks=False):
                try:
                    child = os.open(entry.name, DIR_FLAGS, dir_fd=fd)
                except OSError:
                    continue
                try:
                    walk(child)
                finally:
                    os.close(child)

    try:
        top = os.open(path, DIR_FLAGS)
    except OSError:
        return
    try:
        walk(top)
    except OSError:
        pass
    finally:
        os.close(top)
