"""Reading and writing the files of a private directory (torch-free, Slurm-free).

Each primitive takes a name relative to an open directory (``dir_fd``, e.g. a
:class:`~slurm_elastic.privatefs.SafeDir`'s) or a path:

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

__all__ = [
    "READ_FLAGS",
    "create_new",
    "open_writable",
    "publish_exclusive",
    "read_regular",
    "replace_file",
    "write_new",
]

PathArg = str | os.PathLike[str]
#: Flags to open a file for reading: no link, no blocking on a FIFO, no controlling tty.
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
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
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
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


def create_new(name: PathArg, *, dir_fd: int | None = None) -> int:
    """Create ``name`` for writing, ``0600``, exclusively and never through a link; return
    the descriptor (the caller writes and closes it: streaming writers).

    Raises:
        FileExistsError: something exists at ``name`` (nothing was opened).
        OSError: the directory cannot be written.
    """
    return os.open(name, _NEW_FLAGS, 0o600, dir_fd=dir_fd)


def open_writable(
    name: PathArg, *, dir_fd: int | None = None, append: bool = False, read: bool = False
) -> int:
    """Open (creating ``0600`` if missing) the regular file ``name`` of this user for
    writing, never through a link and never blocking on a FIFO; return the descriptor.

    For files written again and again in place (a progress line, ``pwrite`` at offset 0)
    or appended to (``append``: each ``write`` of a line lands whole at the end);
    ``read``: open it for reading too.

    Raises:
        OSError: ``ELOOP`` (a symbolic link), ``ENXIO`` (a FIFO without a reader),
            ``EISDIR`` (a FIFO with one, a device), ``EPERM`` (another user's file), or
            what the open raised.
    """
    flags = os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    flags |= (os.O_RDWR if read else os.O_WRONLY) | (os.O_APPEND if append else 0)
    fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)  # never write into a pipe, a device or someone else's file
        why = "not a regular file" if not stat.S_ISREG(st.st_mode) else "not yours"
        code = errno.EISDIR if not stat.S_ISREG(st.st_mode) else errno.EPERM
        raise OSError(code, why, os.fspath(name))
    return fd


def write_new(
    name: PathArg, data: bytes, *, dir_fd: int | None = None, fsync: bool = False
) -> None:
    """Create ``name`` (``0600``, exclusively, never through a link) holding ``data``.

    Raises:
        FileExistsError: something exists at ``name`` (nothing was opened).
        OSError: the directory cannot be written.
    """
    fd = create_new(name, dir_fd=dir_fd)
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
