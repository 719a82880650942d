"""``slurm-elastic logs JOB [--node N] [--rank R] [--follow]``: per-rank worker logs.

The agent writes each worker's output to its own files (torch's log layout under
``state_dir/logs/<run_id>`` unless ``log_dir`` is set), a new directory per restart
attempt and per agent process (a requeued task starts a new agent), so nothing is
overwritten; each ``agent.workers_started`` event names the files of that round by global
rank. This command prints them in the order the rounds started, every line prefixed
``[<node> rank <R> #<attempt>]`` (``err`` for stderr). Runs whose events name no worker
files (older runs, ``--redirects`` chosen by hand) fall back to the node output files
(Slurm's ``StdOut``, local ``node<i>.log``), prefixed with the file's name.

``--node`` matches a node key (``12_3``, a host, ``host:pid``), a host name, or an array
task index; ``--rank`` a global rank (ranks are those of the round the lines come from).
``--follow`` keeps printing new lines and new rounds until the run ends.

The run directory is input (:mod:`slurm_elastic.cli.untrusted`): a file an event names is
read only inside the run's state (or log) directory, never through a link leading out of
it, and only if it is a regular file; at most the last :data:`TAIL_BYTES` of a file are
printed and lines are cut at :data:`MAX_LINE_BYTES`, so a huge or endless file costs
bounded memory; control characters are printed escaped. What is skipped is said once on
stderr, with the path.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TextIO

from slurm_elastic import events as ev
from slurm_elastic.cli.runs import RunLocation, locate
from slurm_elastic.cli.summary import summarize_run
from slurm_elastic.cli.untrusted import UnsafeFileError, open_inside, printable, warn
from slurm_elastic.slurm.commands import SlurmClient

__all__ = ["MAX_LINE_BYTES", "TAIL_BYTES", "LogSource", "log_sources", "run_logs"]

#: Of a longer log (or a longer stretch written since the last look, ``--follow``) only
#: the last this many bytes are printed, and a warning says how much was skipped.
TAIL_BYTES = 16 << 20
#: A longer line is cut here (and says so); the rest of it is read and dropped.
MAX_LINE_BYTES = 64 << 10
_CHUNK = 1 << 16
_RANK = re.compile(r"[0-9]{1,9}")


@dataclass(frozen=True)
class LogSource:
    """One file of worker (or node) output and the prefix of its lines.

    ``roots``: the directories it must lie in (the run's, for files named by events).
    """

    path: Path
    prefix: str
    node: str
    host: str
    rank: int | None
    start: float
    roots: tuple[Path, ...] = ()


def run_directories(location: RunLocation) -> tuple[Path, ...]:
    """Where the files named by the run's events may lie: its state and log directories."""
    return tuple(p for p in (location.state_dir, location.log_dir) if p is not None)


def log_sources(location: RunLocation) -> list[LogSource]:
    """Every log file of the run, in the order their rounds started."""
    evs = list(ev.read_events(location.events_dir))
    summary = summarize_run(location.run_id, str(location.events_dir), evs)
    roots = run_directories(location)
    attempts: dict[str, int] = {}
    out: list[LogSource] = []
    for e in evs:
        if not isinstance(e, ev.WorkersStarted) or not e.logs:
            continue
        node = summary.agents.get((e.host, e.pid), e.host)
        attempts[node] = attempts.get(node, 0) + 1
        for rank_text, stdout in sorted(e.logs.items(), key=lambda kv: (len(kv[0]), kv[0])):
            if not _RANK.fullmatch(rank_text) or not Path(stdout).name or "\0" in stdout:
                where = location.events_dir / f"{e.host}.{e.pid}.jsonl"
                if not where.exists():  # merged: the process is gone (events.compact)
                    where = location.events_dir / f"{e.host}.{ev.ARCHIVE}.jsonl"
                warn(
                    f"skipping the log entry {rank_text!r}: {stdout!r} of the {e.kind} event "
                    f"of time {e.time} in {str(where)!r}: an entry maps a global rank (digits) "
                    "to a file path; the other logs are shown"
                )
                continue
            rank = int(rank_text)
            for name, tag in (("stdout.log", ""), ("stderr.log", " err")):
                path = Path(stdout).with_name(name)
                prefix = f"[{node} rank {rank} #{attempts[node]}{tag}]"
                out.append(LogSource(path, prefix, node, e.host, rank, e.time, roots))
    if out:
        return out
    return [
        LogSource(p, f"[{p.stem}]", p.stem, "", None, 0.0, (p.parent,))
        for p in location.output_files
    ]


def _matches(src: LogSource, node: str | None, rank: int | None) -> bool:
    if rank is not None and src.rank != rank:
        return False
    if node is None:
        return True
    task = src.node.rsplit("_", 1)[-1] if "_" in src.node else None
    return node in (src.node, src.host, task)


@dataclass
class _Cursor:
    """How far one file was printed."""

    identity: tuple[int, int]  # (st_dev, st_ino): a replaced file starts over
    offset: int = 0
    pending: bytearray = field(default_factory=bytearray)  # a line not ended yet
    dropping: bool = False  # in a line already cut (or begun before a skip): drop to its end


class _Tail:
    """Prints the new complete lines of files (remembers how far each was read).

    Reads are bounded whatever the file: at most :data:`TAIL_BYTES` from its end, in
    chunks, lines cut at :data:`MAX_LINE_BYTES`; files are opened by :func:`open_inside`.
    """

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.cursors: dict[Path, _Cursor] = {}

    def pump(self, src: LogSource) -> int:
        """Print what ``src`` holds beyond what was printed; return the lines printed."""
        try:
            fd, info = open_inside(src.path, src.roots)
        except UnsafeFileError as exc:
            warn(f"skipping log: {exc}")
            return 0
        except FileNotFoundError:
            return 0  # not written (yet)
        except OSError as exc:
            warn(f"cannot read log {str(src.path)!r}: {exc.strerror}; check its permissions")
            return 0
        with os.fdopen(fd, "rb", buffering=0) as fh:
            identity = (info.st_dev, info.st_ino)
            cursor = self.cursors.get(src.path)
            if cursor is None or cursor.identity != identity or info.st_size < cursor.offset:
                cursor = self.cursors[src.path] = _Cursor(identity)
            if info.st_size - cursor.offset > TAIL_BYTES:
                self._skip_to_tail(src, fh, cursor, info.st_size)
            fh.seek(cursor.offset)
            left = info.st_size - cursor.offset  # what is there now: a growing file waits
            lines = 0
            while left > 0:
                chunk = fh.read(min(_CHUNK, left))
                if not chunk:
                    break
                left -= len(chunk)
                cursor.offset += len(chunk)
                lines += self._feed(src, cursor, chunk)
        self.out.flush()
        return lines

    def _skip_to_tail(self, src: LogSource, fh: BinaryIO, cursor: _Cursor, size: int) -> None:
        start = size - TAIL_BYTES
        warn(
            f"{str(src.path)!r}: {start - cursor.offset} bytes skipped, showing its last "
            f"{TAIL_BYTES >> 20} MiB; read the file itself for the rest"
        )
        fh.seek(start - 1)
        cursor.dropping = fh.read(1) != b"\n"  # begun before the skip: not a whole line
        cursor.pending.clear()
        cursor.offset = start

    def _feed(self, src: LogSource, cursor: _Cursor, chunk: bytes) -> int:
        lines, pos = 0, 0
        while pos < len(chunk):
            end = chunk.find(b"\n", pos)
            piece = chunk[pos : len(chunk) if end < 0 else end]
            if not cursor.dropping:
                room = MAX_LINE_BYTES - len(cursor.pending)
                cursor.pending += piece[:room]
                if len(piece) > room:  # too long: print its start, drop the rest
                    self._write(src, cursor.pending, cut=True)
                    lines += 1
                    cursor.pending.clear()
                    cursor.dropping = True
            if end < 0:
                break
            if not cursor.dropping:
                self._write(src, cursor.pending)
                lines += 1
            cursor.pending.clear()
            cursor.dropping = False
            pos = end + 1
        return lines

    def _write(self, src: LogSource, raw: bytes | bytearray, *, cut: bool = False) -> None:
        if not cut and raw.endswith(b"\r"):
            raw = raw[:-1]  # a CRLF line end
        text = printable(bytes(raw).decode("utf-8", errors="replace"), keep_tabs=True)
        note = f" [line cut at {MAX_LINE_BYTES} bytes]" if cut else ""
        self.out.write(f"{printable(src.prefix)} {text}{note}\n")

    def finish(self, sources: list[LogSource]) -> None:
        """Print the last lines that did not end (a worker killed mid-line)."""
        for src in sources:
            cursor = self.cursors.get(src.path)
            if cursor is not None and cursor.pending and not cursor.dropping:
                self._write(src, cursor.pending)
                cursor.pending.clear()
        self.out.flush()


def run_logs(
    job: str,
    *,
    node: str | None = None,
    rank: int | None = None,
    follow: bool = False,
    interval_s: float = 1.0,
    client: SlurmClient | None = None,
    out: TextIO | None = None,
) -> int:
    """``slurm-elastic logs``; returns the exit status (0, or 1 when no log file matched).

    Raises:
        RunNotFoundError: ``job`` names no run.
    """
    from slurm_elastic.cli.status import collect

    stream = sys.stdout if out is None else out
    location = locate(job, client)
    tail = _Tail(stream)
    matched = False
    while True:
        sources = [s for s in log_sources(location) if _matches(s, node, rank)]
        matched |= bool(sources)
        for src in sources:
            tail.pump(src)
        if not follow:
            break
        if collect(location, client).state in ("COMPLETED", "FAILED", "CANCELLED"):
            for src in sources:  # what was written before the end
                tail.pump(src)
            break
        try:
            time.sleep(interval_s)
        except KeyboardInterrupt:
            break
    tail.finish(sources)
    if not matched:
        what = "".join(
            [f" --node {node}" if node else "", f" --rank {rank}" if rank is not None else ""]
        )
        print(
            printable(
                f"slurm-elastic: no logs for run {location.run_id}{what} (events: "
                f"{location.events_dir}); check --node/--rank against 'slurm-elastic status'"
            ),
            file=sys.stderr,
        )
        return 1
    return 0
