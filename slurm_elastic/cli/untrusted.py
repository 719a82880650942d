"""What ``status``, ``logs`` and ``timeline`` take from a run directory is input.

A run directory lives on a shared filesystem; a neighbour who can write into it, or a
damaged disk, decides what its files hold. So the commands that read it:

* open a file named by the events only inside the run's own directories
  (:func:`open_inside`): the path is resolved and must lie below one of them; it is then
  opened component by component from the directory down, relative to held descriptors and
  without following a link, so nothing swapped in meanwhile is followed either; a FIFO,
  device or socket is refused (opened with ``O_NONBLOCK``, so a FIFO cannot block the
  open), and so is a file that is neither the reader's nor the run directory owner's;
* print nothing raw (:func:`printable`): control characters from events or logs (escape
  sequences, carriage returns, C1 controls, bidirectional overrides) come out as ``\\x1b``
  so that they cannot drive the terminal;
* say what they skipped once, on stderr, naming the path and what to do (:func:`warn`).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

from slurm_elastic.errors import UnsafeFileError
from slurm_elastic.privatefs import DIR_FLAGS, READ_FLAGS

__all__ = ["UnsafeFileError", "open_inside", "printable", "warn"]

# C0 controls (but tab, in the first), DEL, C1 controls, line/paragraph separators and
# bidirectional overrides (which reorder what a terminal shows).
_OTHERS = r"\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_CONTROL = re.compile(rf"[\x00-\x08\x0a-\x1f{_OTHERS}]")
_CONTROL_OR_TAB = re.compile(rf"[\x00-\x1f{_OTHERS}]")


_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}

_warned: set[str] = set()


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, *, keep_tabs: bool = False) -> str:
    """``text`` with every control character written as an escape (``\\x1b``, ``\\r``
    as ``\\x0d``...), so printing it cannot move the cursor, retitle or clear a terminal.

    Newlines are escaped too: call it per line. ``keep_tabs`` leaves tabs (log lines).
    """
    pattern = _CONTROL if keep_tabs else _CONTROL_OR_TAB
    return pattern.sub(_escape, text)


def warn(message: str) -> None:
    """Print ``slurm-elastic: warning: MESSAGE`` on stderr, once per process (``--follow``
    and ``--watch`` re-read the run every second)."""
    if message in _warned:
        return
    _warned.add(message)
    print(f"slurm-elastic: warning: {printable(message)}", file=sys.stderr, flush=True)


def _below(real: str, root: str) -> list[str] | None:
    """The components of ``real`` below ``root`` (both resolved), or None if not below."""
    rel = os.path.relpath(real, root)
    parts = rel.split(os.sep)
    if rel in ("", ".") or parts[0] == os.pardir:
        return None
    return parts


def _open_beneath(root: str, parts: list[str], path: Path) -> tuple[int, os.stat_result]:
    owners = {os.geteuid()}
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        owners.add(os.fstat(fd).st_uid)
        for name in parts[:-1]:
            child = os.open(name, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
        leaf = os.open(parts[-1], READ_FLAGS, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeFileError(
                f"{str(path)!r} changed into a symbolic link while it was opened (someone "
                "is swapping files in the run directory); not read"
            ) from None
        raise
    finally:
        os.close(fd)
    info = os.fstat(leaf)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        kind = _KINDS.get(stat.S_IFMT(info.st_mode), stat.filemode(info.st_mode))
        problem = (
            f"{str(path)!r} is not a regular file ({kind}); only regular files are read: "
            "remove it or read it yourself"
        )
    elif info.st_uid not in owners:
        problem = (
            f"{str(path)!r} is owned by uid {info.st_uid}, neither by you nor by the owner "
            f"of the run directory {root!r}; someone else put it there: check and remove it"
        )
    if problem is not None:
        os.close(leaf)
        raise UnsafeFileError(problem)
    return leaf, info


def open_inside(path: str | os.PathLike[str], roots: Sequence[Path]) -> tuple[int, os.stat_result]:
    """Open ``path`` for reading if it is a regular file inside one of ``roots``.

    Args:
        path: a file named by the run's events (or its node output files).
        roots: the run's directories (trusted: the user named them, or the run index did).

    Returns:
        The open descriptor (the caller closes it) and its ``fstat``.

    Raises:
        UnsafeFileError: ``path`` lies outside every root (itself or through a link), a
            link was swapped in while opening, it is no regular file (a FIFO, a device),
            or someone else owns it; the message names it and says what to do.
        OSError: it cannot be opened (missing, no permission).
    """
    path = Path(path)
    if "\0" in str(path):
        raise UnsafeFileError(f"{str(path)!r} holds a NUL byte: no file has such a name")
    real = os.path.realpath(path)
    for root in roots:
        real_root = os.path.realpath(root)
        parts = _below(real, real_root)
        if parts is not None:
            return _open_beneath(real_root, parts, path)
    where = " or ".join(repr(str(r)) for r in roots)
    via = f" (a symbolic link to {real!r})" if real != os.path.abspath(path) else ""
    raise UnsafeFileError(
        f"{str(path)!r}{via} lies outside the run directory "
        + (where or "(unknown: pass the run's state directory)")
        + "; files outside it are not read: read it yourself if you trust it"
    )
