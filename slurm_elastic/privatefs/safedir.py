"""An open, checked directory: every private-path check of the package (torch-free).

:class:`SafeDir` holds a directory's descriptor. Everything is relative to it
(``openat``-style, ``dir_fd=``) and never follows a symbolic link, so swapping a
directory or planting a link after the check cannot redirect a read or a write:

* :meth:`SafeDir.open_tree` walks a path down from a user-owned anchor, one no-follow
  ``openat`` at a time, creating what is missing ``0700`` *exactly* (``mkdir`` filters its
  mode through the umask and, under a setgid parent, adds ``S_ISGID``: the new directory
  is ``fchmod``-ed) and checking each component with ``fstat``: owned by this user, a
  directory, not writable by group or others (see ``level``);
* :meth:`SafeDir.open_checked` opens and checks one directory by its path (a root a user
  may point elsewhere through a link);
* :meth:`SafeDir.subdir` and :meth:`SafeDir.open_file` open what is inside, checked the
  same way; the file primitives of :mod:`slurm_elastic.privatefs.files` do the writes.

Domains subclass it to word their errors (the rendezvous' ``RendezvousDir`` raises
``RendezvousSetupError``, the checkpoints' ``CheckpointDir`` ``UntrustedCheckpointError``);
the checks and the messages' substance (the path, what was found, the fix) are the ones
here. :data:`FS_OPS` counts this process's metadata operations (the rendezvous benchmark
reads it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import socket
import stat
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from slurm_elastic.errors import UnsafeDirectoryError
from slurm_elastic.privatefs.checks import link_problem, parts_of, prefix, refusal
from slurm_elastic.privatefs.files import (
    READ_FLAGS,
    open_writable,
    publish_exclusive,
    read_regular,
    replace_file,
)
from slurm_elastic.privatefs.ops import FS_OPS

__all__ = ["DIR_FLAGS", "SafeDir"]

#: Flags to open a directory: never through a link.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_HOST = (socket.gethostname().split(".")[0] or "host").replace("/", "_")
_D = TypeVar("_D", bound="SafeDir")


class SafeDir:
    """A checked directory held open; all operations are relative to its descriptor.

    Build one with :meth:`open_tree` or :meth:`open_checked`, or :meth:`subdir` of
    another. The descriptor is closed by :meth:`close`, at the end of a ``with`` block,
    or when the object is garbage-collected.

    Subclasses word the errors (:meth:`_refuse`, :meth:`_missing`, :meth:`_failed`).

    Attributes:
        fd: the held descriptor.
        path: the path it was opened as (for messages only; never re-resolved).
    """

    def __init__(self, fd: int, path: Path | str) -> None:
        self.fd = fd
        self._path = os.fspath(path)  # a string: Path objects cost more than the syscalls
        self._path_obj: Path | None = None
        self._finalizer = weakref.finalize(self, os.close, fd)

    # -- the domain's words ----------------------------------------------------------------

    @classmethod
    def _refuse(cls, problem: str) -> Exception:
        """The error for an unsafe path (``problem`` names it and the fix)."""
        return UnsafeDirectoryError(problem)

    @classmethod
    def _missing(cls, path: str) -> Exception:
        """The error for a directory that must exist and does not."""
        return FileNotFoundError(errno.ENOENT, "no such directory", path)

    @classmethod
    def _failed(cls, path: str, exc: OSError, doing: str) -> Exception:
        """The error for a directory that cannot be created or opened."""
        return OSError(
            exc.errno,
            f"cannot {doing} directory {path} ({exc.strerror}); point it at a writable "
            "directory on the shared filesystem",
        )

    # -- the held directory ----------------------------------------------------------------

    @property
    def path(self) -> Path:
        if self._path_obj is None:
            self._path_obj = Path(self._path)
        return self._path_obj

    def _child(self, name: str) -> str:
        return f"{self._path.rstrip('/')}/{name}"

    @property
    def proc_path(self) -> Path:
        """``/proc/self/fd/<fd>``: this very directory, for readers that take only a path
        (valid while it is held, in this process)."""
        return Path(f"/proc/self/fd/{self.fd}")

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        self._finalizer()

    def __enter__(self: _D) -> _D:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._path!r})"

    def deleted(self) -> bool:
        """Whether this directory was removed from the filesystem while held open."""
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return True

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def open_checked(cls: type[_D], path: str | os.PathLike[str], *, follow: bool = True) -> _D:
        """Open the directory ``path`` by its path and check it (``level="strict"``).

        Args:
            follow: follow a symbolic link at ``path`` itself (a root a user may point
                elsewhere); the components above are resolved by the OS.

        Raises:
            FileNotFoundError: it does not exist.
            the domain's refusal: a link (``follow`` false), not a directory, not ours,
                writable by group/others, or a symbolic link loop.
            OSError: it cannot be opened (I/O, permission, too many open files).
        """
        text = os.path.abspath(path)
        FS_OPS.add("open")
        try:
            fd = os.open(text, DIR_FLAGS if not follow else DIR_FLAGS & ~os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno == errno.ELOOP and follow:
                raise cls._refuse(
                    f"{text} cannot be resolved: a symbolic link loop ({exc.strerror}); "
                    "point it at a real directory"
                ) from exc
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise cls._refuse(link_problem(text, os.path.islink(text))) from exc
            raise
        return cls._adopt(fd, text, level="strict")

    @classmethod
    def _adopt(cls: type[_D], fd: int, path: str, *, level: str, created: bool = False) -> _D:
        """Wrap the directory descriptor ``fd`` once its ``fstat`` passes (closed if not)."""
        held = cls(fd, path)
        try:
            st = os.fstat(fd)
            if created and st.st_uid == os.geteuid():
                os.fchmod(fd, 0o700)  # exact: no umask, no inherited setgid or ACL bits
                st = os.fstat(fd)
            problem = refusal(path, st, level=level)
        except BaseException:
            held.close()
            raise
        if problem is not None:
            held.close()
            raise cls._refuse(problem)
        return held

    @classmethod
    def open_tree(
        cls: type[_D],
        path: Path | str,
        *,
        create: bool = True,
        anchor: Path | str | None = None,
        sticky_ok: bool = True,
    ) -> _D:
        """Open ``path`` walking down from a user-owned anchor without following links.

        Args:
            path: the directory to open (made absolute, not resolved).
            create: create missing components (``0700`` exactly), the anchor's missing
                ancestors included.
            anchor: an ancestor from which every component down to ``path`` must be
                owned by the user (so a component planted by someone else is refused)
                and not writable by group/others (see ``sticky_ok``).
                Default: the topmost directory of the run of user-owned directories
                that ends at ``path``'s deepest existing ancestor (or that ancestor's
                child, when it is not owned by the user: then everything is created);
                a derived anchor only needs to be the user's (e.g. a group-writable
                project directory: a group member could rename what is below it, but
                never make us use a directory we do not own).
            sticky_ok: a component between the anchor and ``path`` may be writable by
                group/others if it has the sticky bit (``path`` itself never).

        Raises:
            the domain's refusal: a component is a link, not a directory, owned by
                someone else or writable by group/others.
            the domain's missing-directory error: ``path`` is missing and ``create``
                is False.
            the domain's failure: a directory cannot be created or opened.
        """
        # Strings, not Path objects: at thousands of agents, parsing paths cost more
        # than the system calls (this runs once per handler).
        target = os.path.abspath(path)
        parts = parts_of(target)  # ("/", "a", "b", ...); prefix i = parts[:i]
        n = len(parts)
        uid = os.geteuid()
        a = _anchor_index(parts, target, anchor, uid)
        a = min(a, n)  # the target itself is always checked
        # Components above the anchor are resolved by the OS (e.g. /home -> /usr/home);
        # from the anchor down, one checked no-follow openat at a time.
        base = prefix(parts, max(a - 1, 1))
        FS_OPS.add("open")
        try:
            fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise cls._failed(base, exc, "open") from exc
        current = cls(fd, base)
        if a == 1 and os.fstat(fd).st_uid != uid:  # the anchor is "/" itself
            current.close()
            raise cls._refuse(f"/ is not owned by you (uid {uid}); choose a directory you own")
        for i in range(max(a - 1, 1), n):
            last = i == n - 1
            derived_anchor = anchor is None and i == a - 1
            if last:
                level = "strict"
            elif derived_anchor:
                level = "anchor"
            else:
                level = "sticky" if sticky_ok else "strict"
            try:
                nxt = current.subdir(parts[i], create=create, level=level)
            finally:
                current.close()
            current = nxt
        return current

    def subdir(self: _D, name: str, *, create: bool = True, level: str = "strict") -> _D:
        """Open (creating ``0700`` if allowed) the child directory ``name``, checked.

        Args:
            name: a single path component.
            create: create it when missing.
            level: see :func:`refusal`.

        Raises:
            see :meth:`open_tree`.
        """
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"{name!r} is not a single path component")
        path = self._child(name)
        created = False
        while True:
            FS_OPS.add("open")
            try:
                fd = os.open(name, DIR_FLAGS, dir_fd=self.fd)
                break
            except FileNotFoundError:
                if not create:
                    raise self._missing(path) from None
                try:
                    FS_OPS.add("mkdir")
                    os.mkdir(name, 0o700, dir_fd=self.fd)
                    created = True
                except FileExistsError:
                    continue  # created concurrently: opened and checked as existing
                except OSError as exc:
                    raise self._failed(path, exc, "create") from exc
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise self._refuse(link_problem(path, self._is_link(name))) from exc
                raise self._failed(path, exc, "open") from exc
        return type(self)._adopt(fd, path, level=level, created=created)

    def _is_link(self, name: str) -> bool:
        try:
            return stat.S_ISLNK(os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode)
        except OSError:
            return False

    def open_file(self, name: str) -> int:
        """Open the regular file ``name`` for reading (never through a link or a FIFO's
        block), check it (ours, not writable by group/others) and return the descriptor
        (the caller closes it).

        Raises:
            FileNotFoundError: it does not exist.
            the domain's refusal: a link, a special file, not ours, writable by others.
            OSError: it cannot be opened.
        """
        path = self._child(name)
        FS_OPS.add("open")
        try:
            fd = os.open(name, READ_FLAGS, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EOPNOTSUPP):
                raise self._refuse(
                    f"{path} is not a regular file (a symbolic link or a special file: "
                    f"{exc.strerror}); links and special files are never read"
                ) from exc
            raise
        try:
            problem = refusal(path, os.fstat(fd), kind="file")
        except BaseException:
            os.close(fd)
            raise
        if problem is not None:
            os.close(fd)
            raise self._refuse(problem)
        return fd

    # -- reading -------------------------------------------------------------------------

    def read(self, name: str, limit: int = 64 << 20) -> bytes | None:
        """Return the content of regular file ``name`` (no symlink), or None if missing
        (:func:`slurm_elastic.privatefs.files.read_regular`).

        Raises:
            OSError: the file exists but cannot be read: ``ELOOP`` for a symlink,
                ``EISDIR`` for a directory, ``EFBIG`` beyond ``limit`` bytes.
        """
        FS_OPS.add("open")
        try:
            got = read_regular(name, limit=limit, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in (errno.EISDIR, errno.EFBIG):  # name the whole path
                raise OSError(exc.errno, exc.strerror, self._child(name)) from None
            raise
        if got is None:
            return None
        FS_OPS.add_bytes(len(got[0]))
        return got[0]

    def open_read(self, name: str) -> int | None:
        """Open regular file ``name`` (no symlink) for reading: a descriptor, or None.

        The caller closes it. Raises ``OSError`` (``ELOOP``, ``EISDIR``) like :meth:`read`.
        """
        FS_OPS.add("open")
        try:
            fd = os.open(name, READ_FLAGS, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EISDIR, f"{self._child(name)} is not a regular file")
        return fd

    def exists(self, name: str) -> bool:
        """Whether ``name`` exists (``lstat``; a symlink counts)."""
        FS_OPS.add("stat")
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def lstat(self, name: str) -> os.stat_result:
        """``lstat`` of ``name`` inside this directory (a link is not followed)."""
        FS_OPS.add("stat")
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def listdir(self) -> list[str]:
        """Return the names in this directory."""
        FS_OPS.add("listdir")
        return os.listdir(self.fd)

    def newest_mtime(self, name: str) -> float:
        """The newest modification time of ``name`` and (a directory's) entries in it."""
        newest = self.lstat(name).st_mtime
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=self.fd)
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

    # -- writing -------------------------------------------------------------------------

    def tmp_name(self, stem: str) -> str:
        """Return a unique temporary name (host, pid and random suffix)."""
        return f".tmp.{stem}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}"

    def link_exclusive(self, name: str, data: bytes, *, fsync: bool = False) -> bool:
        """Publish ``data`` as ``name`` only if that name does not exist yet
        (:func:`slurm_elastic.privatefs.files.publish_exclusive`: a temporary file, then
        ``link``; readers never see a partial file).

        Returns:
            True when this call created the name; False when it existed already.
        """
        FS_OPS.add("open")
        FS_OPS.add("link")
        FS_OPS.add("unlink")
        return publish_exclusive(name, data, dir_fd=self.fd, fsync=fsync, tmp=self.tmp_name(name))

    def replace(self, name: str, data: bytes, *, fsync: bool = False) -> None:
        """Atomically replace ``name`` with ``data`` (temporary file + rename,
        :func:`slurm_elastic.privatefs.files.replace_file`)."""
        FS_OPS.add("open")
        FS_OPS.add("rename")
        replace_file(name, data, dir_fd=self.fd, fsync=fsync, tmp=self.tmp_name(name))

    def write_in_place(self, name: str, data: bytes) -> None:
        """Overwrite the start of ``name`` with ``data``, creating it ``0600`` if missing.

        For counters: the file keeps its inode, so a writer costs one ``open`` per update
        whatever the number of nodes. Closing the file flushes it to the server on NFS
        (close-to-open consistency).
        """
        FS_OPS.add("open")
        fd = open_writable(name, dir_fd=self.fd)
        try:
            os.pwrite(fd, data, 0)
        finally:
            os.close(fd)

    def touch(self, name: str) -> None:
        """Create the empty file ``name`` (``0600``) if missing."""
        FS_OPS.add("open")
        os.close(open_writable(name, dir_fd=self.fd))

    def claim(self, name: str) -> bool:
        """Create the empty directory ``name`` (``0700``) exclusively: one ``mkdir``.

        Returns:
            True when this call created it; False when it existed already.
        """
        FS_OPS.add("mkdir")
        try:
            os.mkdir(name, 0o700, dir_fd=self.fd)
            return True
        except FileExistsError:
            return False

    def mkdir(self, name: str) -> None:
        """Create the directory ``name``, ``0700`` exactly (no umask, no inherited
        ``S_ISGID``).

        Raises:
            OSError: it cannot be created or exists (the error names the whole path).
        """
        FS_OPS.add("mkdir")
        try:
            os.mkdir(name, 0o700, dir_fd=self.fd)
            fd = os.open(name, DIR_FLAGS, dir_fd=self.fd)
        except OSError as exc:  # name the whole path in the caller's message
            raise OSError(exc.errno, exc.strerror, self._child(name)) from exc
        try:
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)

    def rename(self, src: str, dst: str, *, dst_dir: SafeDir | None = None) -> None:
        """``rename(2)`` ``src`` to ``dst`` (in ``dst_dir``, default this directory); a link
        is renamed, never followed."""
        FS_OPS.add("rename")
        os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=(dst_dir or self).fd)

    def sync(self) -> None:
        """fsync this directory (renames and creations in it become durable)."""
        os.fsync(self.fd)

    # -- removing ------------------------------------------------------------------------

    def remove(self, name: str) -> None:
        """Unlink ``name``, ignoring a missing file."""
        FS_OPS.add("unlink")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def rmdir(self, name: str) -> None:
        """Remove the *empty* directory ``name`` (errors ignored)."""
        FS_OPS.add("unlink")
        with contextlib.suppress(OSError):
            os.rmdir(name, dir_fd=self.fd)

    def remove_tree(self, name: str, *, after_first: Callable[[], None] | None = None) -> None:
        """Remove ``name``, never following a link.

        A link (or any non-directory) is unlinked: the name goes, its target is not
        touched. A directory is emptied through its own descriptor, then removed;
        ``after_first`` is called after its first entry is gone (a crash point for tests).

        Raises:
            FileNotFoundError: ``name`` is gone.
            OSError: it cannot be removed.
        """
        FS_OPS.add("unlink")
        _remove_at(self.fd, name, after_first)

    def rmtree(self, name: str) -> None:
        """Delete the tree ``name`` without following links (errors ignored).

        The tree is first renamed to a private trash name, atomically, so it disappears
        from its name at once even when deleting it takes a while.
        """
        trash = self.tmp_name(f"trash.{name}")
        try:
            self.rename(name, trash)
        except FileNotFoundError:
            return
        except OSError:
            trash = name
        with contextlib.suppress(OSError):
            self.remove_tree(trash)


def _anchor_index(parts: tuple[str, ...], target: str, anchor: Path | str | None, uid: int) -> int:
    """How many components of ``parts`` lead to the anchor (see :meth:`SafeDir.open_tree`)."""
    n = len(parts)
    existing = 1
    for i in range(n, 0, -1):
        FS_OPS.add("stat")
        if os.path.lexists(prefix(parts, i)):
            existing = i
            break
    if anchor is not None:
        anchor_parts = parts_of(os.path.abspath(anchor))
        if parts[: len(anchor_parts)] != anchor_parts:
            raise ValueError(
                f"anchor {prefix(anchor_parts, len(anchor_parts))} is not an ancestor of {target}"
            )
        return min(len(anchor_parts), existing + 1)
    a = existing + 1
    while a > 1:
        FS_OPS.add("stat")
        st = os.lstat(prefix(parts, a - 1))
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            break
        a -= 1
    return a


def _remove_at(dir_fd: int, name: str, after_first: Callable[[], None] | None) -> None:
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
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
