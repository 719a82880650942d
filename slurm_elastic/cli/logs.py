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
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from slurm_elastic import events as ev
from slurm_elastic.cli.runs import RunLocation, locate
from slurm_elastic.cli.summary import summarize_run
from slurm_elastic.slurm.commands import SlurmClient

__all__ = ["LogSource", "log_sources", "run_logs"]


@dataclass(frozen=True)
class LogSource:
    """One file of worker (or node) output and the prefix of its lines."""

    path: Path
    prefix: str
    node: str
    host: str
    rank: int | None
    start: float


def log_sources(location: RunLocation) -> list[LogSource]:
    """Every log file of the run, in the order their rounds started."""
    evs = list(ev.read_events(location.events_dir))
    summary = summarize_run(location.run_id, str(location.events_dir), evs)
    attempts: dict[str, int] = {}
    out: list[LogSource] = []
    for e in evs:
        if not isinstance(e, ev.WorkersStarted) or not e.logs:
            continue
        node = summary.agents.get((e.host, e.pid), e.host)
        attempts[node] = attempts.get(node, 0) + 1
        for rank_text, stdout in sorted(e.logs.items(), key=lambda kv: int(kv[0])):
            rank = int(rank_text)
            for name, tag in (("stdout.log", ""), ("stderr.log", " err")):
                path = Path(stdout).with_name(name)
                prefix = f"[{node} rank {rank} #{attempts[node]}{tag}]"
                out.append(LogSource(path, prefix, node, e.host, rank, e.time))
    if out:
        return out
    return [LogSource(p, f"[{p.stem}]", p.stem, "", None, 0.0) for p in location.output_files]


def _matches(src: LogSource, node: str | None, rank: int | None) -> bool:
    if rank is not None and src.rank != rank:
        return False
    if node is None:
        return True
    task = src.node.rsplit("_", 1)[-1] if "_" in src.node else None
    return node in (src.node, src.host, task)


class _Tail:
    """Prints the new complete lines of files (remembers how far each was read)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.offsets: dict[Path, int] = {}

    def pump(self, src: LogSource) -> int:
        try:
            with open(src.path, "rb") as fh:
                fh.seek(self.offsets.get(src.path, 0))
                data = fh.read()
        except OSError:
            return 0
        end = data.rfind(b"\n") + 1  # a partial last line waits for its end
        if end == 0:
            return 0
        self.offsets[src.path] = self.offsets.get(src.path, 0) + end
        lines = data[:end].decode("utf-8", errors="replace").splitlines()
        for line in lines:
            self.out.write(f"{src.prefix} {line}\n")
        self.out.flush()
        return len(lines)


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
    if not matched:
        what = "".join(
            [f" --node {node}" if node else "", f" --rank {rank}" if rank is not None else ""]
        )
        print(
            f"slurm-elastic: no logs for run {location.run_id}{what} (events: "
            f"{location.events_dir}); check --node/--rank against 'slurm-elastic status'",
            file=sys.stderr,
        )
        return 1
    return 0
