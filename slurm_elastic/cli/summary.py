"""Fold a run's events (and Slurm's view of its tasks) into what status and timeline show.

:func:`summarize_run` is pure: events in, :class:`RunSummary` out (the Slurm tasks are
passed in), so it is tested on recorded event files. :meth:`RunSummary.to_json` is the
stable ``slurm-elastic status --json`` schema documented in ``docs/operability.md``.

A *node* is one agent slot of the job: an array task (``12_3``, stable across requeues,
whatever host it lands on), else a host (one agent per node of an allocation), else, for
local runs where every agent shares one host, one agent process (``host:pid``). Agent and
rendezvous events are attributed to a node through the ``agent.start`` event of the
process that wrote them.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from slurm_elastic import events as ev
from slurm_elastic.slurm.window import NoticeWindow, WindowVerdict, plan_window, save_estimate

__all__ = [
    "STATUS_SCHEMA",
    "Interval",
    "NodeSummary",
    "RunSummary",
    "SlurmTask",
    "summarize_run",
]

#: The ``schema`` value of ``status --json``; bumped only by an incompatible change.
STATUS_SCHEMA = "slurm-elastic.status/1"

#: Throughput is averaged over the progress reports of this many last seconds.
THROUGHPUT_WINDOW_S = 60.0

_EXIT_STATES = {
    "FINISHED": "finished",
    "PREEMPTED_REQUEUED": "requeued",
    "PREEMPTED": "preempted",
    "TERMINATED": "terminated",
}


@dataclass(frozen=True)
class SlurmTask:
    """Slurm's view of one task of the job (from the SlurmClient seam)."""

    ref: str
    state: str
    nodes: str = ""
    restarts: int | None = None
    reason: str | None = None
    exit_code: str = ""  # "code:signal" as Slurm prints it; "" when unknown


@dataclass(frozen=True)
class Interval:
    """A node's workers were in a training world from ``start`` to ``end``."""

    start: float
    end: float | None  # None: still in it
    world_nodes: int


@dataclass
class NodeSummary:
    """One node of the run (see the module docstring)."""

    key: str
    name: str = ""
    job: str | None = None
    state: str = "starting"
    rank: int | None = None
    restarts: int = 0
    requeues: int = 0
    preemptions: int = 0
    last_seen: float | None = None
    last_heartbeat: float | None = None
    intervals: list[Interval] = field(default_factory=list)

    def _close(self, when: float) -> None:
        if self.intervals and self.intervals[-1].end is None:
            last = self.intervals[-1]
            self.intervals[-1] = Interval(last.start, when, last.world_nodes)


@dataclass
class RunSummary:
    """Everything ``status`` prints and ``timeline`` draws."""

    run_id: str
    events_dir: str
    now: float
    state: str = "UNKNOWN"
    started: float | None = None
    ended: float | None = None
    round: int | None = None
    world_nodes: int = 0
    world_workers: int = 0
    step: int | None = None
    total_steps: int | None = None
    steps_per_s: float | None = None
    samples_per_s: float | None = None
    checkpoint: ev.CheckpointSaved | None = None
    checkpoints: list[ev.CheckpointSaved] = field(default_factory=list)
    nodes: dict[str, NodeSummary] = field(default_factory=dict)
    agents: dict[tuple[str, int], str] = field(default_factory=dict)  # (host, pid) -> node
    world_series: list[tuple[float, int]] = field(default_factory=list)
    throughput_series: list[tuple[float, float]] = field(default_factory=list)  # NaN: gap
    marks: list[tuple[float, str, str]] = field(default_factory=list)  # time, node key, what
    slurm_job: str | None = None
    slurm_tasks: list[SlurmTask] = field(default_factory=list)
    slurm_error: str | None = None
    unknown_events: int = 0
    event_count: int = 0
    window: ev.AgentWindow | None = None  # the last agent.window: the task's warning

    def window_verdict(self) -> WindowVerdict | None:
        """Whether the run's recent durable saves fit the warning its tasks get (the
        last ``agent.window`` event and the ``checkpoint.saved`` durations); ``None``
        when no agent recorded a window (older versions)."""
        w = self.window
        if w is None:
            return None
        notice = NoticeWindow(
            signal_lead_s=w.signal_lead_s,
            grace_time_s=w.grace_time_s,
            kill_wait_s=w.kill_wait_s,
            partition=w.partition,
            preemptable=w.preemptable,
        )
        saves = save_estimate([c.seconds for c in self.checkpoints])
        return plan_window(notice, w.shutdown_timeout_s, saves)

    @property
    def elapsed_s(self) -> float | None:
        """Seconds from the first event to the end (or to now while running)."""
        if self.started is None:
            return None
        return (self.ended if self.ended is not None else self.now) - self.started

    @property
    def fraction(self) -> float | None:
        """Training progress 0..1 when the events carry a total, else ``None``."""
        if self.step is None or not self.total_steps:
            return None
        return max(0.0, min(1.0, self.step / self.total_steps))

    def to_json(self) -> dict[str, Any]:
        """The ``status --json`` document (schema :data:`STATUS_SCHEMA`)."""
        ckpt = self.checkpoint
        return {
            "schema": STATUS_SCHEMA,
            "run_id": self.run_id,
            "events_dir": self.events_dir,
            "state": self.state,
            "now": self.now,
            "started": self.started,
            "ended": self.ended,
            "elapsed_s": self.elapsed_s,
            "round": self.round,
            "world": {"nodes": self.world_nodes, "workers": self.world_workers},
            "progress": {
                "step": self.step,
                "total_steps": self.total_steps,
                "fraction": self.fraction,
            },
            "throughput": {
                "steps_per_s": self.steps_per_s,
                "samples_per_s": self.samples_per_s,
                "window_s": THROUGHPUT_WINDOW_S,
            },
            "checkpoint": None
            if ckpt is None
            else {
                "step": ckpt.step,
                "path": ckpt.path,
                "time": ckpt.time,
                "age_s": self.now - ckpt.time,
            },
            "counts": self._counts_json(),
            "nodes": [self._node_json(n) for n in self.nodes.values()],
            "preemption_window": _window_json(self.window_verdict()),
            "slurm": self._slurm_json(),
        }

    def _counts_json(self) -> dict[str, int]:
        return {
            "restarts": sum(n.restarts for n in self.nodes.values()),
            "preemptions": sum(n.preemptions for n in self.nodes.values()),
            "requeues": sum(1 for _, _, what in self.marks if what == "requeue"),
            "checkpoints": len(self.checkpoints),
            "events": self.event_count,
            "unknown_events": self.unknown_events,
        }

    def _node_json(self, n: NodeSummary) -> dict[str, Any]:
        return {
            "node": n.key,
            "host": n.name,
            "job": n.job,
            "state": n.state,
            "rank": n.rank,
            "restarts": n.restarts,
            "requeues": n.requeues,
            "last_heartbeat": n.last_heartbeat,
            "last_heartbeat_age_s": None
            if n.last_heartbeat is None
            else self.now - n.last_heartbeat,
        }

    def _slurm_json(self) -> dict[str, Any] | None:
        if self.slurm_job is None:
            return None
        return {
            "job": self.slurm_job,
            "error": self.slurm_error,
            "tasks": [
                {
                    "ref": t.ref,
                    "state": t.state,
                    "nodes": t.nodes,
                    "restarts": t.restarts,
                    "reason": t.reason,
                }
                for t in self.slurm_tasks
            ],
        }


def _window_json(verdict: WindowVerdict | None) -> dict[str, Any] | None:
    if verdict is None:
        return None
    return {
        "save_s": verdict.save_s,
        "fits": verdict.fits,
        "windows": [
            {"case": c.name, "seconds": c.seconds, "made_of": c.made_of} for c in verdict.cases
        ],
        "unknown": list(verdict.unknown),
        "problems": verdict.problems(),
    }


def _natural(key: str) -> list[Any]:
    """``12_10`` after ``12_9``: digits compare as numbers (by length, then digits: no
    int() of a host name of 5000 digits)."""
    out: list[Any] = []
    for part in re.split(r"([0-9]+)", key):
        digits = part.lstrip("0")
        out.append((0, len(digits), digits) if part.isdigit() else (1, 0, part))
    return out


def _node_key(start: ev.AgentStart, shared_hosts: set[str]) -> str:
    if start.job and "_" in start.job:
        return start.job
    if start.host in shared_hosts:
        return f"{start.host}:{start.pid}"
    return start.host


def _throughput(
    progress: Sequence[ev.TrainProgress], now: float
) -> tuple[float | None, float | None, list[tuple[float, float]]]:
    """(steps/s, samples/s) over the last window, and the steps/s series."""
    series: list[tuple[float, float]] = []
    for a, b in itertools.pairwise(progress):
        dt, ds = b.time - a.time, b.step - a.step
        if a.pid != b.pid:  # a new worker (restart): a gap, not a line across it
            series.append((b.time, math.nan))
        elif dt > 0 and ds > 0 and math.isfinite(ds / dt):
            series.append((b.time, ds / dt))
    if not progress:
        return None, None, series
    last = progress[-1]
    same = [p for p in progress if p.pid == last.pid and p.time >= last.time - THROUGHPUT_WINDOW_S]
    if len(same) < 2 or same[-1].time <= same[0].time:
        rates = [r for _, r in series if not math.isnan(r)]
        return (rates[-1] if rates else None), None, series
    dt = same[-1].time - same[0].time
    steps: float | None = (same[-1].step - same[0].step) / dt
    samples = None
    if same[-1].samples is not None and same[0].samples is not None:
        samples = (same[-1].samples - same[0].samples) / dt
    steps = steps if steps is not None and math.isfinite(steps) else None
    samples = samples if samples is not None and math.isfinite(samples) else None
    return steps, samples, series


def summarize_run(
    run_id: str,
    events_dir: str,
    events: Iterable[ev.Event],
    *,
    now: float | None = None,
    heartbeats: dict[str, float] | None = None,
    slurm_job: str | None = None,
    slurm_tasks: Sequence[SlurmTask] = (),
    slurm_error: str | None = None,
) -> RunSummary:
    """Fold ``events`` (ordered by time) into a :class:`RunSummary`.

    Args:
        heartbeats: rendezvous node name -> mtime of its heartbeat file, when readable.
        slurm_tasks: Slurm's records of the job's tasks (empty for local runs).
    """
    evs = list(events)
    out = RunSummary(run_id=run_id, events_dir=events_dir, now=time.time() if now is None else now)
    out.event_count = len(evs)
    out.slurm_job, out.slurm_tasks, out.slurm_error = slurm_job, list(slurm_tasks), slurm_error
    if evs:
        out.started = evs[0].time
    fold = _Fold(out, _shared_hosts(evs))
    for e in evs:
        fold.add(e)
    for name, mtime in (heartbeats or {}).items():
        beating = fold.rdzv_name.get(name)
        if beating is not None and beating.key in out.nodes:
            beating.last_heartbeat = max(mtime, beating.last_heartbeat or 0.0)
    for node in out.nodes.values():
        if node.last_heartbeat is None:
            node.last_heartbeat = node.last_seen
    out.nodes = dict(sorted(out.nodes.items(), key=lambda kv: _natural(kv[0])))
    out.steps_per_s, out.samples_per_s, out.throughput_series = _throughput(fold.progress, out.now)
    if not fold.progress and len(out.checkpoints) >= 2:  # no progress reports: use checkpoints
        a, b = out.checkpoints[-2], out.checkpoints[-1]
        if b.time > a.time and b.step > a.step:
            out.steps_per_s = (b.step - a.step) / (b.time - a.time)
    out.state = _state(out, fold.alive, evs)
    if out.state not in ("RUNNING", "PENDING", "UNKNOWN") and evs:
        out.ended = evs[-1].time
        if out.world_series and out.world_series[-1][1] != 0:
            out.world_series.append((evs[-1].time, 0))
    return out


def _shared_hosts(evs: Sequence[ev.Event]) -> set[str]:
    """Hosts where several agents ran with no Slurm job to tell them apart (their nodes
    are then named ``host:pid``)."""
    starts = [e for e in evs if isinstance(e, ev.AgentStart)]
    hosts: dict[str, set[int]] = {}
    for s in starts:
        if not (s.job and "_" in s.job):
            hosts.setdefault(s.host, set()).add(s.pid)
    return {
        h
        for h, pids in hosts.items()
        if len(pids) > 1 and not any(s.job for s in starts if s.host == h)
    }


class _Fold:
    """Folding a run's events into its :class:`RunSummary`, one event at a time.

    An agent's events are told apart by ``(host, pid)``; the rendezvous names nodes by
    its own names (evictions, heartbeats), mapped here to the agents' nodes.
    """

    def __init__(self, out: RunSummary, shared: set[str]) -> None:
        self.out = out
        self.shared = shared
        self.proc_node: dict[tuple[str, int], NodeSummary] = {}
        self.rdzv_name: dict[str, NodeSummary] = {}
        self.progress: list[ev.TrainProgress] = []
        self.alive: set[tuple[str, int]] = set()

    def add(self, e: ev.Event) -> None:
        """Fold in one event (the next by time)."""
        out = self.out
        if isinstance(e, ev.UnknownEvent):
            out.unknown_events += 1
            return
        if isinstance(e, ev.AgentStart):
            key = _node_key(e, self.shared)
            started = out.nodes.setdefault(key, NodeSummary(key=key))
            started.name, started.job, started.state = e.host, e.job, "starting"
            started.requeues = max(started.requeues, e.requeue_count)
            self.proc_node[(e.host, e.pid)] = started
            out.agents[(e.host, e.pid)] = key
            self.alive.add((e.host, e.pid))
            return
        node = self.proc_node.get((e.host, e.pid))
        if node is not None:
            node.last_seen = e.time
        self._membership(e, node)  # the kinds of the two are disjoint: one acts at most
        self._training(e)

    def _membership(self, e: ev.Event, node: NodeSummary | None) -> None:
        """The agents' and the rendezvous' events: nodes, worlds, marks."""
        out = self.out
        if isinstance(e, ev.RendezvousComplete):
            out.round = e.round
            self.rdzv_name[e.node] = node if node is not None else NodeSummary(key=e.node)
            if node is not None:
                node.rank, node.state = e.rank, "joined"
        elif isinstance(e, (ev.WorkersStarted, ev.AgentReformedInPlace)):
            # A new round: workers (re)started, or the live workers switched in place.
            out.world_nodes, out.world_workers = e.group_world_size, e.world_size
            if not out.world_series or out.world_series[-1][1] != e.group_world_size:
                out.world_series.append((e.time, e.group_world_size))
            if node is not None:
                node._close(e.time)
                node.intervals.append(Interval(e.time, None, e.group_world_size))
                node.state = "training"
        elif isinstance(e, ev.AgentRestart) and node is not None:
            node._close(e.time)
            node.restarts += 1
            node.state = "restarting"
            out.marks.append((e.time, node.key, "restart"))
        elif isinstance(e, ev.AgentHang) and node is not None:
            out.marks.append((e.time, node.key, "hang"))
        elif isinstance(e, ev.AgentSignal) and node is not None:
            node._close(e.time)
            if e.notice:
                node.preemptions += 1
                node.state = "preempting"
                out.marks.append((e.time, node.key, "preempt"))
            else:
                node.state = f"signalled ({e.signal})"
        elif isinstance(e, ev.RendezvousLeft) and node is not None:
            node.state = "left"
        elif isinstance(e, ev.RendezvousEvicted):
            for name in e.nodes:
                gone = self.rdzv_name.get(name)
                if gone is not None:
                    gone._close(e.time)
                    gone.state = {
                        "link": "evicted (process gone)",
                        "unreachable": "evicted (unreachable)",
                    }.get(e.cause, "evicted (no heartbeat)")
                    out.marks.append((e.time, gone.key, "evicted"))
                    if e.cause == "link":  # its process is gone: it writes no exit
                        self.alive -= {a for a, k in out.agents.items() if k == gone.key}
        elif isinstance(e, ev.AgentRequeued) and node is not None:
            node.state = "requeued"
            out.marks.append((e.time, node.key, "requeue"))
        elif isinstance(e, ev.WorkersSucceeded) and node is not None:
            node._close(e.time)
            node.state = "finished"
        elif isinstance(e, ev.AgentGaveUp) and node is not None:
            node.state = "failed"
        elif isinstance(e, ev.AgentExit) and node is not None:
            node._close(e.time)
            self.alive.discard((e.host, e.pid))
            if node.state != "requeued" or e.code != "PREEMPTED_REQUEUED":
                node.state = _EXIT_STATES.get(e.code, f"exited {e.code}".strip())
        elif isinstance(e, ev.AgentWindow):
            out.window = e

    def _training(self, e: ev.Event) -> None:
        """The training's and the checkpoints' events: step, total, throughput."""
        out = self.out
        if isinstance(e, ev.CheckpointSaved):
            out.checkpoint = e
            out.checkpoints.append(e)
            out.marks.append((e.time, "", "checkpoint"))
            out.step = e.step if out.step is None else max(out.step, e.step)
        elif isinstance(e, ev.TrainStart):
            out.step = e.step
            out.total_steps = e.total_steps or out.total_steps
        elif isinstance(e, ev.TrainProgress):
            self.progress.append(e)
            out.step = e.step
            out.total_steps = e.total_steps or out.total_steps
        elif isinstance(e, ev.TrainDone):
            out.step = e.step if out.step is None else max(out.step, e.step)


def _state(out: RunSummary, alive: set[tuple[str, int]], evs: list[ev.Event]) -> str:
    """The run's state: Slurm's summary when known, else from the agents' exits."""
    if out.slurm_tasks:
        from slurm_elastic.slurm.jobstate import job_state_from_slurm
        from slurm_elastic.submit.job import SLURM_STATES, JobState, summarize

        states = [
            SLURM_STATES.get(job_state_from_slurm(t.state), JobState.UNKNOWN)
            for t in out.slurm_tasks
        ]
        return summarize(states).value
    if not evs:
        return "PENDING" if out.slurm_job else "UNKNOWN"
    if alive:
        return "RUNNING"
    codes = [e.code for e in evs if isinstance(e, ev.AgentExit)]
    if any(n.state == "requeued" for n in out.nodes.values()) and "FINISHED" not in codes:
        return "PENDING"  # a requeued task will come back
    if "FINISHED" in codes:
        return "COMPLETED"
    # each node's last exit: a task requeued earlier and stopped later ended stopped
    last = {
        out.agents.get((e.host, e.pid), f"{e.host}:{e.pid}"): e.code
        for e in evs
        if isinstance(e, ev.AgentExit)
    }
    if last and all(c in ("PREEMPTED", "TERMINATED") for c in last.values()):
        return "CANCELLED"
    return "FAILED" if codes else "UNKNOWN"
