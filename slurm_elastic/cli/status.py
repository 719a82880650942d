"""``slurm-elastic status JOB [--watch] [--json]``: where a run stands, at a glance.

Without JOB (:func:`list_status`): one line per run of the per-user run index, the most
recently started first (``--last N`` of them, 10 by default): its state, start, elapsed
time, world, step and state directory, so a run can be found without its job id.

JOB is a Slurm job id, an array job id, a run id or the run's state directory (see
:mod:`slurm_elastic.cli.runs`). The table shows the run's state, elapsed time, round and
world size, training progress (a bar when the events carry a total), recent throughput,
the last checkpoint (step and age), one line per node (Slurm job or array task, state,
restarts, requeues, last heartbeat) and Slurm's state of each task. ``--json`` prints the
same as one document of the schema in ``docs/operability.md``; ``--watch`` redraws it.

:class:`ProgressPrinter` is the one-line progress (elapsed, state, world size, bar) that
``status --watch`` and ``submit --wait`` print.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from slurm_elastic import events as ev
from slurm_elastic.cli.runs import RunLocation, from_index, locate
from slurm_elastic.cli.summary import THROUGHPUT_WINDOW_S, RunSummary, SlurmTask, summarize_run
from slurm_elastic.cli.untrusted import printable
from slurm_elastic.errors import SlurmElasticError, SlurmError
from slurm_elastic.exit_codes import ExitCode, describe
from slurm_elastic.slurm.commands import SlurmClient

__all__ = [
    "ProgressPrinter",
    "WaitProgress",
    "collect",
    "format_duration",
    "list_status",
    "progress_line",
    "render_table",
    "run_status",
]

log = logging.getLogger(__name__)

_HB_NAME = re.compile(r"[^A-Za-z0-9._-]")  # as rendezvous.heartbeat.node_file_name


def format_duration(seconds: float | None) -> str:
    """``93`` -> ``1m33s``; ``None`` -> ``-``."""
    if seconds is None:
        return "-"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _bar(fraction: float, width: int = 24) -> str:
    filled = round(fraction * width)
    return "[" + "#" * filled + "." * (width - filled) + f"] {fraction * 100:3.0f}%"


def _heartbeats(summary_nodes: list[str], config_rdzv: str | None, run_id: str) -> dict[str, float]:
    """Rendezvous node name -> mtime of its heartbeat file (the newest of any era; a run
    directory of a version before 2026-12-03 names its eras ``epoch.<k>``)."""
    if not config_rdzv:
        return {}
    out: dict[str, float] = {}
    root = Path(config_rdzv) / run_id
    wanted = {_HB_NAME.sub("_", n)[:200]: n for n in summary_nodes}
    for hb in [*root.glob("era.*/hb/*"), *root.glob("epoch.*/hb/*")]:
        name = wanted.get(hb.name)
        if name is None:
            continue
        try:
            mtime = hb.lstat().st_mtime
        except OSError:
            continue
        out[name] = max(out.get(name, 0.0), mtime)
    return out


def _slurm_tasks(job: str, client: SlurmClient) -> tuple[list[SlurmTask], str | None]:
    try:
        infos = client.job_infos(job)
    except SlurmError as exc:
        return [], str(exc).splitlines()[0][:200]
    tasks = [
        SlurmTask(
            ref=i.ref if i.array_task_id is not None or i.array_job_id is None else f"{i.job_id}*",
            state=i.state.value,
            nodes=i.node_list,
            restarts=i.restarts,
            reason=i.reason,
            exit_code=i.exit_code,
        )
        for i in infos
    ]
    return sorted(tasks, key=lambda t: t.ref), None


def collect(
    location: RunLocation, client: SlurmClient | None = None, *, slurm: bool = True
) -> RunSummary:
    """Read the run's events (and Slurm's task states) into a summary."""
    evs = list(ev.read_events(location.events_dir))
    rdzv = None
    for e in evs:
        if isinstance(e, ev.AgentStart):
            endpoint, state_dir = e.config.get("rdzv_endpoint"), e.config.get("state_dir")
            if endpoint is None and e.config.get("rdzv_backend") == "slurm":
                # the agent's default (AgentConfig.rdzv_dir): <state_dir>/rdzv
                endpoint = os.path.join(state_dir, "rdzv") if isinstance(state_dir, str) else None
            rdzv = endpoint if isinstance(endpoint, str) and "\0" not in endpoint else rdzv
    names = [e.node for e in evs if isinstance(e, ev.RendezvousComplete)]
    tasks: list[SlurmTask] = []
    error = None
    if slurm and location.slurm_job is not None:
        tasks, error = _slurm_tasks(location.slurm_job, client or SlurmClient())
    return summarize_run(
        location.run_id,
        str(location.events_dir),
        evs,
        heartbeats=_heartbeats(names, rdzv, location.run_id),
        slurm_job=location.slurm_job,
        slurm_tasks=tasks,
        slurm_error=error,
    )


def progress_line(s: RunSummary) -> str:
    """One line: elapsed, state, world size, step (and a bar when the total is known)."""
    parts = [f"{format_duration(s.elapsed_s):>7}", f"{s.state:<9}"]
    parts.append(f"world {s.world_nodes} node(s)/{s.world_workers} worker(s)")
    if s.fraction is not None:
        parts.append(f"{_bar(s.fraction)} step {s.step}/{s.total_steps}")
    elif s.step is not None:
        parts.append(f"step {s.step}")
    if s.steps_per_s:
        parts.append(f"{s.steps_per_s:.2f} steps/s")
    return printable("  ".join(parts))  # the state and host names come from files


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    rows = [[printable(cell) for cell in row] for row in rows]  # names come from files
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*headers), fmt.format(*("-" * w for w in widths))] + [
        fmt.format(*r) for r in rows
    ]


def render_table(s: RunSummary) -> str:
    """The human-readable status of one run."""
    ckpt = s.checkpoint
    lines = [
        f"run {s.run_id}   state {s.state}   elapsed {format_duration(s.elapsed_s)}"
        + ("" if s.ended is None else " (ended)"),
        f"round {s.round if s.round is not None else '-'}   world "
        f"{s.world_nodes} node(s) / {s.world_workers} worker(s)",
    ]
    if s.fraction is not None:
        lines.append(f"progress {_bar(s.fraction)}  step {s.step}/{s.total_steps}")
    elif s.step is not None:
        lines.append(f"progress step {s.step}")
    speed = "-" if s.steps_per_s is None else f"{s.steps_per_s:.2f} steps/s"
    if s.samples_per_s is not None:
        speed += f", {s.samples_per_s:.1f} samples/s"
    lines.append(f"throughput {speed} (last {THROUGHPUT_WINDOW_S:.0f} s)")
    lines.append(
        "last checkpoint "
        + ("-" if ckpt is None else f"step {ckpt.step}, {format_duration(s.now - ckpt.time)} ago")
        + f"   ({len(s.checkpoints)} saved)"
    )
    verdict = s.window_verdict()
    if verdict is not None:
        # the partition's name comes from the run's files
        lines.append(printable(verdict.summary()))
        lines += [printable(f"WARNING: {problem}") for problem in verdict.problems()]
    lines.append("")
    rows = [
        [
            n.key,
            n.name,
            n.job or "-",
            n.state,
            "-" if n.rank is None else str(n.rank),
            str(n.restarts),
            str(n.requeues),
            "-" if n.last_heartbeat is None else f"{format_duration(s.now - n.last_heartbeat)} ago",
        ]
        for n in s.nodes.values()
    ]
    lines += _table(
        ["NODE", "HOST", "SLURM JOB", "STATE", "RANK", "RESTARTS", "REQUEUES", "LAST HEARTBEAT"],
        rows,
    )
    if s.slurm_job is not None:
        lines.append("")
        if s.slurm_tasks:
            lines += _table(
                ["SLURM TASK", "STATE", "NODES", "RESTARTS", "REASON"],
                [
                    [
                        t.ref,
                        t.state,
                        t.nodes or "-",
                        "-" if t.restarts is None else str(t.restarts),
                        t.reason or "-",
                    ]
                    for t in s.slurm_tasks
                ],
            )
            lines += _failed_task_hints(s.slurm_tasks)
        else:
            lines.append(f"slurm job {s.slurm_job}: {s.slurm_error or 'no record'}")
    if s.unknown_events:
        lines.append(f"({s.unknown_events} event(s) of kinds this version does not know)")
    lines.append(f"events: {s.events_dir}")
    return "\n".join(printable(line) for line in lines) + "\n"


#: What an agent's failing exit status says about a task that ended with it.
_FAILED_AGENT = {
    ExitCode.FAILED: "its workers kept failing (max_restarts spent)",
    ExitCode.USAGE: "it refused to start (configuration, or the run's directories or "
    "owner: nothing was started)",
    ExitCode.RENDEZVOUS_FAILED: "it could not join the rendezvous",
}


def _failed_task_hints(tasks: list[SlurmTask]) -> list[str]:
    """One line per task that ended with a failing agent status: what it means, and
    where the agent wrote why (the task's own output: the run's events and worker logs
    may be an earlier job's when the agent refused to start)."""
    lines = []
    for t in tasks:
        code = t.exit_code.split(":", 1)[0]
        if t.state != "FAILED" or not code.isdigit() or int(code) not in _FAILED_AGENT:
            continue
        meaning = _FAILED_AGENT[ExitCode(int(code))]
        lines.append(
            f"task {t.ref}: agent exit {code} ({describe(int(code))}): {meaning}; the reason "
            f"is the ERROR line of the task's Slurm output (scontrol show job {t.ref}: StdOut)"
        )
    return lines


class ProgressPrinter:
    """Prints :func:`progress_line` of a run while something waits for it.

    On a terminal the line is redrawn in place; otherwise a line is printed when state,
    world size or progress decile change, and at least every ``every_s`` seconds.
    """

    def __init__(self, out: TextIO | None = None, every_s: float = 30.0) -> None:
        self.out = sys.stdout if out is None else out
        self.every_s = every_s
        self._last_key: tuple[Any, ...] | None = None
        self._last_time = 0.0
        self._tty = bool(getattr(self.out, "isatty", lambda: False)())

    def show(self, line: str, key: tuple[Any, ...]) -> None:
        """Print ``line`` (key: what counts as a change for non-terminal output)."""
        if self._tty:
            self.out.write("\r\x1b[K" + line)
            self.out.flush()
            return
        now = time.monotonic()
        if key != self._last_key or now - self._last_time >= self.every_s:
            self.out.write(line + "\n")
            self.out.flush()
            self._last_key, self._last_time = key, now

    def summary(self, s: RunSummary) -> None:
        """Show the progress of a summarized run."""
        decile = None if s.fraction is None else int(s.fraction * 10)
        self.show(progress_line(s), (s.state, s.world_nodes, decile))

    def end(self) -> None:
        """Finish the in-place line (terminal only)."""
        if self._tty:
            self.out.write("\n")
            self.out.flush()


def run_status(
    job: str,
    *,
    as_json: bool = False,
    watch: bool = False,
    interval_s: float = 2.0,
    client: SlurmClient | None = None,
    out: TextIO | None = None,
    goodput: bool = False,
) -> int:
    """``slurm-elastic status``; returns the exit status (0).

    ``goodput``: print where the run's time went instead (:mod:`slurm_elastic.cli.goodput`),
    from the event log alone.

    Raises:
        RunNotFoundError: ``job`` names no run.
        SlurmElasticError: ``goodput`` with ``watch``.
    """
    stream = sys.stdout if out is None else out
    if goodput and watch:
        raise SlurmElasticError("status --goodput takes no --watch: run it again to refresh")
    location = locate(job, client)
    if goodput:
        from slurm_elastic.cli.goodput import account, render_goodput

        evs = list(ev.read_events(location.events_dir))
        summary = summarize_run(location.run_id, str(location.events_dir), evs)
        result = account(evs, now=None if summary.ended is not None else summary.now)
        if as_json:
            doc = {"run_id": location.run_id, "state": summary.state, **result.to_json()}
            stream.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        else:
            text = render_goodput(location.run_id, result)  # the run id comes from files
            stream.write("".join(printable(line) + "\n" for line in text.splitlines()))
        return 0
    if not watch:
        summary = collect(location, client)
        if as_json:
            stream.write(json.dumps(summary.to_json(), indent=2, sort_keys=True) + "\n")
        else:
            stream.write(render_table(summary))
        return 0
    tty = bool(getattr(stream, "isatty", lambda: False)())
    try:
        while True:
            summary = collect(location, client)
            if as_json:
                stream.write(json.dumps(summary.to_json(), sort_keys=True) + "\n")
            else:
                if tty:
                    stream.write("\x1b[H\x1b[2J")
                stream.write(progress_line(summary) + "\n" + render_table(summary) + "\n")
            stream.flush()
            if summary.state in ("COMPLETED", "FAILED", "CANCELLED"):
                return 0
            time.sleep(interval_s)
    except KeyboardInterrupt:
        return 0


def list_status(
    *,
    last: int = 10,
    as_json: bool = False,
    client: SlurmClient | None = None,
    out: TextIO | None = None,
) -> int:
    """``slurm-elastic status`` without JOB: the newest ``last`` runs of the run index.

    Each run is read as ``status JOB`` reads it (its events, and Slurm's record of its
    tasks while Slurm knows the job). Runs whose events directory is gone (a deleted
    state directory) are counted, not listed. Returns the exit status (0).

    Raises:
        SlurmElasticError: ``last`` is below 1.
    """
    if last < 1:
        raise SlurmElasticError(f"--last {last}: must be at least 1 (the number of runs to list)")
    stream = sys.stdout if out is None else out
    entries = ev.list_runs()
    located = [(e, loc) for e in entries if (loc := from_index(e)) is not None]
    gone = len(entries) - len(located)
    client = client or SlurmClient()  # one for all runs (it remembers a disabled sacct)
    docs = [_run_line(e, collect(loc, client)) for e, loc in located[:last]]
    index = ev.run_index_dir()
    if as_json:
        doc = {"runs": docs, "older": len(located) - len(docs), "gone": gone, "index": str(index)}
        stream.write(json.dumps(doc, indent=2) + "\n")
        return 0
    lines = []
    if docs:
        rows = [
            [
                d["run_id"],
                d["state"],
                "-" if d["started"] is None else _local_time(d["started"]),
                format_duration(d["elapsed_s"]),
                str(d["world_nodes"]),
                "-" if d["step"] is None else str(d["step"]),
                d["state_dir"],
            ]
            for d in docs
        ]
        lines += _table(["RUN", "STATE", "STARTED", "ELAPSED", "NODES", "STEP", "STATE DIR"], rows)
        lines.append("")
    else:
        lines.append("no runs: their agents record a run when they start")
    if len(located) > len(docs):
        lines.append(f"{len(located) - len(docs)} older run(s) not shown (--last N)")
    if gone:
        lines.append(f"{gone} run(s) whose state directory is gone not shown")
    lines.append(f"run index: {index}; one run: slurm-elastic status RUN (or its state directory)")
    stream.write("".join(printable(line).rstrip() + "\n" for line in lines))
    return 0


def _local_time(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _run_line(entry: ev.RunIndexEntry, summary: RunSummary) -> dict[str, Any]:
    """One run of :func:`list_status`, as its JSON document."""
    return {
        "run_id": entry.run_id, "state": summary.state, "started": summary.started,
        "elapsed_s": summary.elapsed_s, "world_nodes": summary.world_nodes,
        "step": summary.step, "state_dir": entry.state_dir, "events_dir": entry.events_dir,
    }  # fmt: skip


class WaitProgress:
    """The ``submit --wait`` progress: call it with ``(job_id, state)`` at each poll."""

    def __init__(self, out: TextIO | None = None, client: SlurmClient | None = None) -> None:
        self._printer = ProgressPrinter(out)
        self._started = time.monotonic()
        self._client = client
        self._location: RunLocation | None = None

    def __call__(self, job_id: str, state: str) -> None:
        if self._location is None:
            # the run index knows the run once its first agent started
            with contextlib.suppress(SlurmElasticError):
                self._location = locate(job_id, self._client or SlurmClient())
        waited = time.monotonic() - self._started
        if self._location is None:
            line = printable(f"{format_duration(waited):>7}  {state:<9}  world -")
            self._printer.show(line, (state,))
            return
        s = collect(self._location, slurm=False)
        s.state = state
        if s.started is None:
            s.started = s.now - waited
        self._printer.summary(s)

    def end(self) -> None:
        """Finish the progress line."""
        self._printer.end()
