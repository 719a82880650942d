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

The files in those directories are read and written through the primitives below (one
implementation for the rendezvous' :class:`~slurm_elastic.rendezvous.filesystem.SafeDir`,
the node channel, the run index, the run keys and the checkpoint manifests). Each takes
a name relative to an open directory (``dir_fd``) or a path:

* :func:`read_regular`: opened without following a link and without blocking (a FIFO
  planted at the name returns at once), refused unless ``fstat`` says a regular file
  (of this user, if asked) no larger than a limit; ``None`` when missing;
* :func:`write_new`: a new file, created exclusively (``O_EXCL | O_NOFOLLOW``, ``0600``),
  fully written, optionally fsynced;
* :func:`replace_file`: a complete new content, atomically (:func:`write_new` to a
  temporary name, then ``rename``): a reader sees the old file or the new one;
* :func:`publish_exclusive`: a complete file at a name that must not exist yet
  (:func:`write_new`, then ``link``): the first writer wins, readers never see a part.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import threading
from pathlib import Path

from slurm_elastic.errors import UnsafeDirectoryError

__all__ = [
    "ensure_private_dir",
    "is_private",
    "private_tree",
    "publish_exclusive",
    "read_regular",
    "replace_file",
    "write_new",
]

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


# -- files -----------------------------------------------------------------------------

PathArg = str | os.PathLike[str]
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def read_regular(
    name: PathArg, *, limit: int, dir_fd: int | None = None, owned: bool = False
) -> tuple[bytes, os.stat_result] | None:
    """The content and ``stat`` of the regular file ``name``; ``None`` when it is missing.

    Args:
        name: a path, or a name relative to ``dir_fd``.
        limit: a larger file is refused unread (one that grows past it while read, too).
        dir_fd: the directory ``name`` is relative to.
        owned: refuse a file that is not this user's.

    Raises:
        OSError: ``ELOOP`` (a symbolic link), ``EISDIR`` (not a regular file: a FIFO, a
            directory, a device), ``EFBIG`` (larger than ``limit``), ``EPERM`` (another
            user's, with ``owned``), or what the open or the read raised.
    """
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EISDIR, "not a regular file", os.fspath(name))
        if owned and st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"owned by uid {st.st_uid}, not you", os.fspath(name))
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{st.st_size} bytes, more than {limit}", os.fspath(name))
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, min(limit + 1 - size, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:  # it grew after the fstat
            raise OSError(errno.EFBIG, f"more than {limit} bytes", os.fspath(name))
        return b"".join(chunks), st
    finally:
        os.close(fd)


def write_new(
    name: PathArg, data: bytes, *, dir_fd: int | None = None, fsync: bool = False
) -> None:
    """Create ``name`` (``0600``, exclusively, never through a link) holding ``data``.

    Raises:
        FileExistsError: something exists at ``name`` (nothing was opened).
        OSError: the directory cannot be written.
    """
    fd = os.open(name, _NEW_FLAGS, 0o600, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _temporary(name: PathArg, tmp: str | None) -> str:
    """The temporary name beside ``name``: ``tmp``, or a unique one."""
    head, base = os.path.split(os.fspath(name))
    if tmp is None:
        return os.path.join(head, f".{base}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    if "/" in tmp or tmp in ("", ".", ".."):
        raise ValueError(f"{tmp!r} is not a file name")
    return os.path.join(head, tmp)


def replace_file(
    name: PathArg,
    data: bytes,
    *,
    dir_fd: int | None = None,
    fsync: bool = False,
    tmp: str | None = None,
    clear_tmp: bool = False,
) -> None:
    """Replace ``name`` with ``data`` atomically: :func:`write_new` to a temporary name
    beside it, then ``rename``. A reader sees the old content or the new, never a part.

    Args:
        tmp: the temporary file's name (default: a unique one).
        clear_tmp: remove what is at ``tmp`` first: for a fixed name (e.g. one per
            process) that a crashed writer may have left, or someone planted (a FIFO, a
            link): it is removed, never opened.

    Raises:
        OSError: the directory cannot be written; nothing is left behind.
    """
    temp = _temporary(name, tmp)
    if clear_tmp:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp, dir_fd=dir_fd)
    write_new(temp, data, dir_fd=dir_fd, fsync=fsync)
    try:
        os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
        raise


def publish_exclusive(
    name: PathArg,
    data: bytes,
    *,
    dir_fd: int | None = None,
    fsync: bool = False,
    tmp: str | None = None,
) -> bool:
    """Publish ``data`` as ``name`` only if that name does not exist yet.

    The content goes to a temporary file first and is then hard-linked to its name:
    ``link(2)`` fails with ``EEXIST`` when the name exists, on every POSIX filesystem
    including NFS and Lustre, and the file appears with its whole content.

    Returns:
        True when this call created the name; False when it existed already.

    Raises:
        OSError: any other filesystem error.
    """
    temp = _temporary(name, tmp)
    write_new(temp, data, dir_fd=dir_fd, fsync=fsync)
    try:
        os.link(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileExistsError:
        # An NFS retransmission can report EEXIST for a link that did succeed: the
        # classic check is whether the name is now our inode.
        try:
            return os.stat(temp, dir_fd=dir_fd, follow_symlinks=False).st_nlink == 2
        except OSError:
            return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
