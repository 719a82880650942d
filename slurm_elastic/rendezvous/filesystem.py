"""The few filesystem operations the rendezvous relies on, made safe and countable.

Everything the rendezvous does on the shared filesystem goes through :class:`SafeDir`,
an *open, checked directory*: every operation is relative to its file descriptor
(``openat``-style, ``dir_fd=``) and never follows a symlink, so swapping a directory or
planting a link after the check cannot redirect a read or a write. The primitives (see
``docs/rendezvous.md``):

* ``mkdir`` (exclusive by nature) and ``rename`` of a freshly built directory,
* ``open(O_CREAT | O_EXCL | O_NOFOLLOW)`` of private temporary files,
* ``link(tmp, name)``: an *exclusive*, atomic publication of an immutable file,
* ``rename(tmp, name)``: an atomic replacement of a small pointer file,
* ``unlink``, ``listdir`` and ``open(O_NOFOLLOW)`` for reading.

No ``flock``/``fcntl`` lock is ever taken: a process that dies at any point leaves at
worst an orphaned temporary file, never a lock that blocks the job.

Security (:meth:`SafeDir.open_tree`): the path is walked component by component from a
*user-owned anchor* with ``O_NOFOLLOW | O_DIRECTORY``; every directory from the anchor
down must be owned by the user, must not be a symlink, and (below the anchor) must not
be writable by group/others unless it has the sticky bit; the directories the
rendezvous uses must not be writable by group/others at all. Missing directories are
created ``0700`` and ``fchmod``-ed to ``0700`` (a permissive umask, a setgid parent
or a default ACL cannot widen them). Files are created ``0600``.

:data:`FS_OPS` counts the metadata operations of this process (``open``, ``stat``,
``link``, ``rename``, ``unlink``, ``mkdir``, ``listdir``) for the benchmark.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import socket
import stat
import threading
import weakref
from collections import Counter
from pathlib import Path

from slurm_elastic.errors import MissingDirectoryError, RendezvousSetupError
from slurm_elastic.privatefs import publish_exclusive, read_regular, replace_file

__all__ = ["FS_OPS", "FsOps", "MissingDirectoryError", "SafeDir", "open_nofollow"]


class FsOps:
    """A thread-safe counter of metadata operations, by kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._bytes = 0

    def add(self, kind: str, n: int = 1) -> None:
        """Count ``n`` operations of ``kind``."""
        with self._lock:
            self._counts[kind] += n

    def add_bytes(self, n: int) -> None:
        """Count ``n`` bytes read from files (state, heartbeats, intents, pointers)."""
        with self._lock:
            self._bytes += n

    def bytes_read(self) -> int:
        """Return the bytes read so far."""
        with self._lock:
            return self._bytes

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
            self._bytes = 0


#: Metadata operations done by this process's rendezvous code.
FS_OPS = FsOps()

_NOFOLLOW = os.O_NOFOLLOW
_CLOEXEC = os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC
_HOST = (socket.gethostname().split(".")[0] or "host").replace("/", "_")


def open_nofollow(path: str | os.PathLike[str], flags: int, mode: int = 0o600) -> int:
    """``os.open`` that never follows a symlink in the *last* component.

    For callers outside the rendezvous (e.g. event files) that must not be redirected
    by a planted link. ``OSError(ELOOP)`` when ``path`` is a symlink.
    """
    return os.open(path, flags | _NOFOLLOW | _CLOEXEC, mode)


def _parts(path: str) -> tuple[str, ...]:
    """The components of absolute normalised ``path``, ``"/"`` first (as ``Path.parts``)."""
    return ("/", *(p for p in path.split("/") if p))


def _prefix(parts: tuple[str, ...], i: int) -> str:
    """The path of the first ``i`` components of ``parts``."""
    return "/" + "/".join(parts[1:i])


def _unsafe(path: str, st: os.stat_result, *, level: str) -> str | None:
    """Why directory ``path`` is unsafe for us, or None."""
    if not stat.S_ISDIR(st.st_mode):
        return f"{path!r} is not a directory; remove it or choose another path"
    if st.st_uid != os.getuid():
        return (
            f"{path!r} is owned by uid {st.st_uid}, not by you (uid {os.getuid()}); the "
            "rendezvous state is unpickled, so only directories you own are safe. Remove "
            "it (or ask its owner to) or choose another rendezvous directory"
        )
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    sticky_ok = level == "sticky" and st.st_mode & stat.S_ISVTX
    if writable and level != "anchor" and not sticky_ok:
        return (
            f"{path!r} has mode {stat.S_IMODE(st.st_mode):04o}, writable by group/others: "
            "someone else could swap what is below it (and so rewrite the rendezvous "
            f"state). Fix: chmod go-w {path!r}"
        )
    return None


class SafeDir:
    """A checked directory held open; all operations are relative to its descriptor.

    Build one with :meth:`open_tree`, or :meth:`subdir` of another. The descriptor is
    closed when the object is garbage-collected or :meth:`close` is called.

    Attributes:
        path: the path it was opened as (for messages only; never re-resolved).
    """

    def __init__(self, fd: int, path: Path | str) -> None:
        self.fd = fd
        self._path = os.fspath(path)  # a string: Path objects cost more than the syscalls
        self._path_obj: Path | None = None
        self._finalizer = weakref.finalize(self, os.close, fd)

    @property
    def path(self) -> Path:
        if self._path_obj is None:
            self._path_obj = Path(self._path)
        return self._path_obj

    def _child(self, name: str) -> str:
        return f"{self._path.rstrip('/')}/{name}"

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        self._finalizer()

    def __repr__(self) -> str:
        return f"SafeDir({self._path!r})"

    # -- opening -----------------------------------------------------------------------

    @classmethod
    def open_tree(
        cls, path: Path | str, *, create: bool = True, anchor: Path | str | None = None
    ) -> SafeDir:
        """Open ``path`` walking down from a user-owned anchor without following links.

        Args:
            path: the directory to open (made absolute, not resolved).
            create: create missing components (``0700``).
            anchor: an ancestor from which every component down to ``path`` must be
                owned by the user (so a component planted by someone else is refused)
                and, the anchor included, not writable by group/others without the
                sticky bit.
                Default: the topmost directory of the run of user-owned directories
                that ends at ``path``'s deepest existing ancestor (or that ancestor's
                child, when it is not owned by the user: then everything is created);
                a derived anchor only needs to be the user's (e.g. a group-writable
                project directory: a group member could rename what is below it, but
                never make us use a directory we do not own).

        Raises:
            RendezvousSetupError: a component is a symlink, not a directory, owned by
                someone else, writable by group/others (without sticky bit, or at all
                for ``path`` itself), cannot be created, or ``path`` is missing and
                ``create`` is False. The message names the path and the fix.
        """
        # Strings, not Path objects: at thousands of agents, parsing paths cost more
        # than the system calls (this runs once per handler).
        target = os.path.abspath(path)
        parts = _parts(target)  # ("/", "a", "b", ...); prefix i = parts[:i]
        n = len(parts)
        uid = os.getuid()
        existing = 1
        for i in range(n, 0, -1):
            FS_OPS.add("stat")
            if os.path.lexists(_prefix(parts, i)):
                existing = i
                break
        if anchor is not None:
            anchor_parts = _parts(os.path.abspath(anchor))
            if parts[: len(anchor_parts)] != anchor_parts:
                raise ValueError(
                    f"anchor {_prefix(anchor_parts, len(anchor_parts))} is not an ancestor "
                    f"of {target}"
                )
            a = min(len(anchor_parts), existing + 1)
        else:
            a = existing + 1
            while a > 1:
                FS_OPS.add("stat")
                st = os.lstat(_prefix(parts, a - 1))
                if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
                    break
                a -= 1
        a = min(a, n)  # the target itself is always checked
        # Components above the anchor are resolved by the OS (e.g. /home -> /usr/home);
        # from the anchor down, one checked no-follow openat at a time.
        base = _prefix(parts, max(a - 1, 1))
        FS_OPS.add("open")
        try:
            fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        except OSError as exc:
            raise RendezvousSetupError(
                f"cannot open {str(base)!r}: {exc}; choose a rendezvous directory you can reach"
            ) from exc
        current = cls(fd, base)
        if a == 1 and os.fstat(fd).st_uid != uid:  # the anchor is "/" itself
            current.close()
            raise RendezvousSetupError(f"'/' is not owned by you (uid {uid})")
        for i in range(max(a - 1, 1), n):
            last = i == n - 1
            derived_anchor = anchor is None and i == a - 1
            level = "strict" if last else ("anchor" if derived_anchor else "sticky")
            try:
                nxt = current.subdir(parts[i], create=create, level=level)
            finally:
                current.close()
            current = nxt
        return current

    def subdir(self, name: str, *, create: bool = True, level: str = "strict") -> SafeDir:
        """Open (creating ``0700`` if allowed) the child directory ``name``, checked.

        Args:
            name: a single path component.
            create: create it when missing.
            level: ``"strict"`` (the directories the rendezvous uses): never writable
                by group/others; ``"sticky"``: writable only with the sticky bit;
                ``"anchor"``: only ownership is checked.

        Raises:
            RendezvousSetupError: see :meth:`open_tree`.
        """
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"{name!r} is not a single path component")
        path = self._child(name)
        created = False
        while True:
            FS_OPS.add("open")
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
                break
            except FileNotFoundError:
                if not create:
                    raise MissingDirectoryError(
                        f"rendezvous directory {str(path)!r} does not exist; create it on "
                        "the shared filesystem or point the endpoint at an existing one"
                    ) from None
                try:
                    FS_OPS.add("mkdir")
                    os.mkdir(name, 0o700, dir_fd=self.fd)
                    created = True
                except FileExistsError:
                    continue
                except OSError as exc:
                    raise RendezvousSetupError(
                        f"cannot create rendezvous directory {str(path)!r}: {exc}; choose a "
                        "writable directory on the shared filesystem"
                    ) from exc
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    kind = "a symlink" if self._is_link(name) else "not a directory"
                    raise RendezvousSetupError(
                        f"rendezvous path {str(path)!r} is {kind}; refusing to follow it "
                        "(someone could redirect the state). Remove it or use the real "
                        "path instead"
                    ) from exc
                raise RendezvousSetupError(
                    f"cannot open rendezvous directory {str(path)!r}: {exc}"
                ) from exc
        child = SafeDir(fd, path)
        st = os.fstat(fd)
        if created and st.st_uid == os.getuid():
            # mkdir's mode is filtered by the umask and may inherit setgid/ACL bits.
            os.fchmod(fd, 0o700)
            st = os.fstat(fd)
        problem = _unsafe(path, st, level=level)
        if problem:
            child.close()
            raise RendezvousSetupError(f"unsafe rendezvous directory: {problem}")
        return child

    def _is_link(self, name: str) -> bool:
        try:
            return stat.S_ISLNK(os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode)
        except OSError:
            return False

    def deleted(self) -> bool:
        """Whether this directory was removed from the filesystem while held open."""
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return True

    # -- files ---------------------------------------------------------------------------

    def tmp_name(self, stem: str) -> str:
        """Return a unique temporary name (host, pid and random suffix)."""
        return f".tmp.{stem}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}"

    def link_exclusive(self, name: str, data: bytes, *, fsync: bool = False) -> bool:
        """Publish ``data`` as ``name`` only if that name does not exist yet
        (:func:`slurm_elastic.privatefs.publish_exclusive`: a temporary file, then
        ``link``; readers never see a partial file).

        Returns:
            True when this call created the name; False when it existed already.

        Raises:
            OSError: any other filesystem error.
        """
        FS_OPS.add("open")
        FS_OPS.add("link")
        FS_OPS.add("unlink")
        return publish_exclusive(name, data, dir_fd=self.fd, fsync=fsync, tmp=self.tmp_name(name))

    def replace(self, name: str, data: bytes, *, fsync: bool = False) -> None:
        """Atomically replace ``name`` with ``data`` (temporary file + rename,
        :func:`slurm_elastic.privatefs.replace_file`)."""
        FS_OPS.add("open")
        FS_OPS.add("rename")
        replace_file(name, data, dir_fd=self.fd, fsync=fsync, tmp=self.tmp_name(name))

    def rename(self, src: str, dst: str, *, dst_dir: SafeDir | None = None) -> None:
        """``rename(2)`` ``src`` to ``dst`` (in ``dst_dir``, default this directory)."""
        FS_OPS.add("rename")
        os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=(dst_dir or self).fd)

    def write_in_place(self, name: str, data: bytes) -> None:
        """Overwrite the start of ``name`` with ``data``, creating it ``0600`` if missing.

        Used for heartbeat counters: the file keeps its inode, so a writer costs one
        ``open`` per update whatever the number of nodes. Closing the file flushes it
        to the server on NFS (close-to-open consistency).
        """
        FS_OPS.add("open")
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o600, dir_fd=self.fd)
        try:
            os.pwrite(fd, data, 0)
        finally:
            os.close(fd)

    def touch(self, name: str) -> None:
        """Create the empty file ``name`` (``0600``) if missing."""
        FS_OPS.add("open")
        os.close(
            os.open(name, os.O_WRONLY | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o600, dir_fd=self.fd)
        )

    def read(self, name: str, limit: int = 64 << 20) -> bytes | None:
        """Return the content of regular file ``name`` (no symlink), or None if missing
        (:func:`slurm_elastic.privatefs.read_regular`).

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
            fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | os.O_NONBLOCK, dir_fd=self.fd)
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

    def listdir(self) -> list[str]:
        """Return the names in this directory."""
        FS_OPS.add("listdir")
        return os.listdir(self.fd)

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

    def rmtree(self, name: str) -> None:
        """Delete the tree ``name`` without following symlinks (errors ignored).

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
        FS_OPS.add("unlink")
        shutil.rmtree(trash, dir_fd=self.fd, ignore_errors=True)  # type: ignore[call-arg]
