"""Reading events back: :func:`read_events` merges a run's files, ordered by time.

The files are input, possibly damaged or planted by someone else: read line by line with
bounds on a record and on a file, never through a link, never a FIFO or device; a
malformed line is skipped with a warning naming the file and the line, a torn last line
(a writer killed mid-write) silently.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from slurm_elastic.events.compact import ARCHIVE
from slurm_elastic.events.records import event_from_record
from slurm_elastic.events.schema import Event
from slurm_elastic.privatefs import READ_FLAGS

__all__ = ["MAX_EVENTS_FILE_BYTES", "MAX_RECORD_BYTES", "read_events"]

log = logging.getLogger(__name__)


#: A record is well under 1 KiB; a longer line is damage, skipped without being held.
MAX_RECORD_BYTES = 1 << 20
#: Of a bigger events file only the first and the last half of this many bytes are read
#: (the run's start and its latest state): memory stays bounded whatever the file.
MAX_EVENTS_FILE_BYTES = 64 << 20
#: Warnings per file and read; the rest of a damaged file is counted, not listed.
_MAX_WARNINGS = 5
_CHUNK = 1 << 16
_warned: set[tuple[str, str]] = set()  # (file, what): said once per process (--watch)


def _warn(path: Path, message: str) -> None:
    key = (str(path), message)
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", message)


def _open_events_file(path: Path) -> BinaryIO | None:
    """``path`` opened for reading: a regular file, not reached through a link; else None."""
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            _warn(
                path,
                f"skipping events file {str(path)!r}: a symbolic link (event files "
                "are never followed; remove it from the run's events directory)",
            )
        else:
            log.debug("skipping events file %s: %s", path, exc)
        return None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        _warn(
            path,
            f"skipping events file {str(path)!r}: not a regular file "
            f"({stat.filemode(mode)}); remove it from the run's events directory",
        )
        return None
    return os.fdopen(fd, "rb")


def _skip_line(fh: BinaryIO, budget: int) -> int:
    """Read (and drop) up to the end of the current line; return the bytes read."""
    used = 0
    while used < budget:
        piece = fh.readline(min(_CHUNK, budget - used))
        if not piece:
            break
        used += len(piece)
        if piece.endswith(b"\n"):
            break
    return used


def _file_lines(path: Path, fh: BinaryIO) -> Iterator[tuple[str, bytes | None]]:
    """(where, line) of each line of an events file; ``None`` for an overlong line.

    ``where`` is ``line N`` (``the line at byte N`` after a skipped middle). Only the
    bytes there when the file was opened are read (a live writer's next lines are the
    next read's). A last line without its newline (a writer mid-write) is not yielded.
    """
    size = os.fstat(fh.fileno()).st_size
    half = MAX_EVENTS_FILE_BYTES // 2
    pos, number, counting = 0, 0, True
    while pos < size:
        if size > MAX_EVENTS_FILE_BYTES and half <= pos < size - half:
            start = size - half  # the middle: skipped, said once
            _warn(
                path,
                f"{str(path)!r} is {size} bytes: read its first and last "
                f"{half >> 20} MiB only (bytes {pos}-{start} skipped)",
            )
            fh.seek(start - 1)
            mid_line = fh.read(1) != b"\n"
            pos = start + (_skip_line(fh, size - start) if mid_line else 0)
            counting = False
            continue
        where = f"line {number + 1}" if counting else f"the line at byte {pos}"
        number += 1
        line = fh.readline(min(MAX_RECORD_BYTES + 1, size - pos))
        if not line:
            return
        pos += len(line)
        if not line.endswith(b"\n"):
            if len(line) <= MAX_RECORD_BYTES:
                return  # torn last line
            pos += _skip_line(fh, size - pos)
            yield where, None
            continue
        yield where, line


def _parse(line: bytes) -> dict[str, Any]:
    """One line's JSON object. NaN and Infinity are no JSON (nor is a number of 5000
    digits or an array nested 100000 deep: ValueError, RecursionError).

    Raises:
        ValueError: not a JSON object.
    """

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not a number in JSON")

    try:
        record = json.loads(line.decode("utf-8", errors="replace"), parse_constant=refuse)
    except RecursionError:
        raise ValueError("nested too deep") from None
    except ValueError as exc:
        raise ValueError(f"not JSON ({str(exc)[:80]})") from None
    if not isinstance(record, dict):
        raise ValueError(f"not a JSON object but {type(record).__name__}")
    return record


def _file_events(path: Path, seen: set[bytes]) -> Iterator[Event]:
    """The well-formed events of one file; the rest skipped with a warning.

    A line already in ``seen`` (digests of the lines read) is dropped: an archive may
    hold a record twice after a crash while merging (:mod:`.compact`).
    """
    fh = _open_events_file(path)
    if fh is None:
        return
    bad = 0
    with fh:
        for where, line in _file_lines(path, fh):
            if line is not None and not line.strip():
                continue
            if line is not None:
                digest = hashlib.blake2b(line.rstrip(b"\n"), digest_size=16).digest()
                if digest in seen:
                    continue
                seen.add(digest)
            try:
                if line is None:
                    raise ValueError(f"longer than {MAX_RECORD_BYTES} bytes")
                event = event_from_record(_parse(line), strict=True)
            except ValueError as exc:
                bad += 1
                if bad <= _MAX_WARNINGS:
                    _warn(path, f"skipping {where} of {str(path)!r}: {exc}")
                continue
            yield event
    if bad > _MAX_WARNINGS:
        _warn(path, f"skipped {bad - _MAX_WARNINGS} more malformed lines of {str(path)!r}")


def _is_archive(path: Path) -> bool:
    return path.name.endswith(f".{ARCHIVE}.jsonl")


def read_events(directory: str | os.PathLike[str]) -> Iterator[Event]:
    """Yield every well-formed event under ``directory``, ordered by time.

    The files are input, possibly damaged or planted by someone else: they are read line
    by line (a record of at most :data:`MAX_RECORD_BYTES`, at most
    :data:`MAX_EVENTS_FILE_BYTES` of a file), never through a link, never a FIFO or
    device. A malformed line (not JSON, no event, a field not of its declared type) is
    skipped with a warning naming the file and the line; a torn last line silently.
    Unknown kinds come back as :class:`UnknownEvent`. A record read twice (the same line,
    in a node's archive and in the file it was merged from: :mod:`.compact`) is yielded
    once; a file merged into its archive while this reads is read from the archive. A
    missing directory yields nothing.
    """
    out: list[Event] = []
    seen: set[bytes] = set()
    paths = sorted(Path(directory).glob("*.jsonl"))
    for path in paths:
        out.extend(_file_events(path, seen))
    if any(not _is_archive(p) and not os.path.lexists(p) for p in paths):
        # merged while this read: its lines were appended to its node's archive before
        # it was removed, so the archives read now hold them (what was read is dropped)
        for path in sorted(Path(directory).glob(f"*.{ARCHIVE}.jsonl")):
            out.extend(_file_events(path, seen))
    out.sort(key=lambda e: e.time)
    yield from out
