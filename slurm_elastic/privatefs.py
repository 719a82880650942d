"""Private directories on a shared filesystem (torch-free, Slurm-free).

Every directory slurm_elastic creates (the state directory and, below it, the rendezvous,
checkpoints, events, logs; the node channel directory, the run
index) is made by :func:`ensure_private_dir`:

* each missing component is created ``0700`` *exactly*: ``mkdir`` filters its mode through
  the umask and, under a setgid parent (a group project directory), adds ``S_ISGID``;
  the new directory is opened without following links and ``fchmod``-ed to ``0700``;
* the walk is relative to held directory descriptors (``openat`` with ``O_NOFOLLOW``):
  a symlink or a directory swapped in by someone else on the way is never followed;
* every existing component of the product's own tree (from ``root`` down to the leaf)
  must be owned by this user and not writable by group or others; otherwise a
  :class:`~slurm_elastic.errors.UnsafeDirectoryError` names it and the ``chmod`` to run.

Directories above ``root`` (a home or project directory) are the user's business: they
are resolved by the OS and may be shared (a group member who can rename entries there
can only exchange whole trees of ours, never make us use a directory we do not own).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path

from slurm_elastic.errors import UnsafeDirectoryError

__all__ = ["ensure_private_dir", "is_private", "private_tree"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_ensured: set[tuple[str, str]] = set()
_lock = threading.Lock()


def is_private(st: os.stat_result) -> bool:
    """Whether ``st`` is a directory of this user that nobody else may write into."""
    return (
        stat.S_ISDIR(st.st_mode)
        and st.st_uid == os.geteuid()
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _refusal(path: Path, st: os.stat_result) -> UnsafeDirectoryError | None:
    uid = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        return UnsafeDirectoryError(
            f"{path} is not a directory ({stat.filemode(st.st_mode)}); remove it or choose "
            "another path"
        )
    if st.st_uid != uid:
        return UnsafeDirectoryError(
            f"{path} is owned by uid {st.st_uid}, not by you (uid {uid}): someone else "
            "controls what is inside. Remove it (or ask its owner to) or choose another path"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return UnsafeDirectoryError(
            f"{path} has mode {stat.filemode(st.st_mode)}, writable by group/others: they "
            f"could swap what is below it. Run: chmod 700 {path}"
        )
    return None


def _open_child(parent_fd: int, name: str, path: Path, create: bool) -> tuple[int, bool]:
    """Open (creating if missing) the child directory ``name``; return ``(fd, created)``."""
    while True:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent_fd), False
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(name, 0o700, dir_fd=parent_fd)
            except FileExistsError:
                continue  # created concurrently: opened and checked as existing
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"cannot create directory {path} ({exc.strerror}); point it at a "
                    "writable directory on the shared filesystem",
                ) from exc
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
            st = os.fstat(fd)
            if st.st_uid == os.geteuid():
                os.fchmod(fd, 0o700)  # exact: no umask, no inherited setgid
            return fd, True
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafeDirectoryError(
                    f"{path} is a symbolic link or not a directory; refusing to follow it "
                    "(it could point anywhere). Remove it or use the real path"
                ) from exc
            raise


def ensure_private_dir(
    path: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None
) -> Path:
    """Create ``path`` and its missing parents ``0700``, or check the existing ones.

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
    below = target.parts[len(top.parts) - 1 :]  # top's name, then down to the leaf
    # Up to top's parent the OS resolves the path; create missing ancestors above top
    # privately too (they are ours when we create them).
    parent = top.parent
    missing: list[str] = []
    while not os.path.lexists(parent) and parent != parent.parent:
        missing.append(parent.name)
        parent = parent.parent
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    current = parent
    try:
        for name in reversed(missing):
            current = current / name
            child, _ = _open_child(fd, name, current, create=True)
            os.close(fd)
            fd = child
            problem = _refusal(current, os.fstat(fd))
            if problem is not None:  # someone else created it meanwhile
                raise problem
        for name in below:
            current = current / name
            child, _ = _open_child(fd, name, current, create=True)
            os.close(fd)
            fd = child
            problem = _refusal(current, os.fstat(fd))
            if problem is not None:
                raise problem
    finally:
        os.close(fd)
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
                    child = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                except OSError:
                    continue
                try:
                    walk(child)
                finally:
                    os.close(child)

    try:
        top = os.open(path, _DIR_FLAGS)
    except OSError:
        return
    try:
        walk(top)
    except OSError:
        pass
    finally:
        os.close(top)
