"""``slurm-elastic status --goodput``: where a run's wall-clock time went, from its events.

:func:`account` is pure: a run's events in, a :class:`Goodput` out. Every second from
the run's first event (the first agent's start) to its end (or now) lands in exactly one
category, so the parts add up to the whole:

* **useful**: stepping that advanced training for the first time;
* **queue wait**: no agent of the run was alive (every task pending, e.g. a whole-job
  requeue). The wait before the first agent started is not in the events (Slurm's
  ``sacct`` has it);
* **start-up**: from the first agent's start to the first training step (rendezvous,
  worker start, checkpoint load);
* **re-formation**: the world changing membership: from the last step before a
  restart to the workers' new start (waiting for a leaver, the next round), or the
  in-place switch (``live.reformed`` ``switch_s``, plus the stall a silent loss caused,
  ``live.collective_aborted`` ``stalled_s``);
* **restarts**: restarted workers, from their start to their first step (interpreter,
  imports, checkpoint load);
* **redone steps**: stepping over steps already done before (after a rollback to a
  checkpoint or to the last in-memory commit), at the step time of that stretch;
* **checkpoint stalls**: the part of each save that blocked training
  (``checkpoint.saved`` ``stall_seconds``);
* **wind-down**: after the last step (the final save, workers and agents exiting);
* **other**: time between two progress reports at the same step with no cause in the
  events.

How: the events that carry a step (``train.start``, ``train.progress``,
``checkpoint.saved``, ``train.preempted``, ``train.done``, ``live.reformed``) form the
run's step trace. Each gap between two consecutive points is stepping when the step
advanced and no worker restart lies in between (``agent.restart``,
``agent.workers_started`` or a new ``train.start`` ends it); a gap with a restart is
re-formation up to the first ``agent.workers_started`` in it and restarts after. Only
the events are read: no Slurm, no clock but the events' own.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from slurm_elastic import events as ev

__all__ = ["CATEGORIES", "GOODPUT_SCHEMA", "Goodput", "Span", "account", "render_goodput"]

#: The ``schema`` value of ``status --goodput --json``.
GOODPUT_SCHEMA = "slurm-elastic.goodput/1"

#: The categories, in the order they are shown; ``useful`` first.
CATEGORIES = (
    "useful",
    "queue wait",
    "start-up",
    "re-formation",
    "restarts",
    "redone steps",
    "checkpoint stalls",
    "wind-down",
    "other",
)


@dataclass(frozen=True)
class Span:
    """``start``..``end`` (Unix seconds) spent in ``category``."""

    start: float
    end: float
    category: str


@dataclass
class Goodput:
    """A run's wall-clock time by category (see the module docstring).

    Attributes:
        start: the run's first event; ``end``: its last (or now while running).
        seconds: category -> seconds (every category present, 0 when none).
        spans: the time line behind the sums (for the timeline picture).
        first_step / last_step: the step training started from and the highest reached.
        redone_steps: steps trained more than once.
        restarts: restarts of the world's workers (one per round that restarted them,
            not per node); ``reformations``: in-place switches.
    """

    start: float | None = None
    end: float | None = None
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    spans: list[Span] = field(default_factory=list)
    first_step: int | None = None
    last_step: int | None = None
    redone_steps: int = 0
    restarts: int = 0
    reformations: int = 0

    @property
    def total_s(self) -> float:
        """The run's wall-clock seconds (the sum of every category)."""
        return 0.0 if self.start is None or self.end is None else self.end - self.start

    @property
    def lost_s(self) -> float:
        """Everything but ``useful``."""
        return sum(v for k, v in self.seconds.items() if k != "useful")

    @property
    def efficiency(self) -> float | None:
        """``useful`` / total (``None`` for an empty run)."""
        return self.seconds["useful"] / self.total_s if self.total_s > 0 else None

    def add(self, start: float, end: float, category: str) -> None:
        """Book ``start``..``end`` (clipped to a positive length) to ``category``."""
        if end > start:
            self.seconds[category] += end - start
            last = self.spans[-1] if self.spans else None
            if last is not None and last.category == category and last.end == start:
                self.spans[-1] = Span(last.start, end, category)  # one span per stretch
            else:
                self.spans.append(Span(start, end, category))

    def to_json(self) -> dict[str, Any]:
        """The ``status --goodput --json`` document."""
        return {
            "schema": GOODPUT_SCHEMA,
            "start": self.start,
            "end": self.end,
            "total_s": self.total_s,
            "useful_s": self.seconds["useful"],
            "lost_s": self.lost_s,
            "efficiency": self.efficiency,
            "seconds": dict(self.seconds),
            "steps": {
                "first": self.first_step,
                "last": self.last_step,
                "redone": self.redone_steps,
            },
            "counts": {"restarts": self.restarts, "reformations": self.reformations},
        }


# -- the step trace ----------------------------------------------------------------------------

#: Events whose ``step`` says where training stood at their ``time``. Not
#: ``checkpoint.saved``: an asynchronous save commits while later steps run.
_STEP_EVENTS = (
    ev.TrainStart,
    ev.TrainProgress,
    ev.TrainPreempted,
    ev.TrainDone,
    ev.LivePeerFailure,
    ev.LiveReformed,
)


@dataclass(frozen=True)
class _Point:
    time: float
    step: int
    start: bool  # a (re)start of training: train.start


def _trace(evs: Sequence[ev.Event]) -> list[_Point]:
    points = [
        _Point(e.time, int(e.step), isinstance(e, ev.TrainStart))
        for e in evs
        if isinstance(e, _STEP_EVENTS)
    ]
    # several ranks report the same start: keep the first of each cluster of starts
    out: list[_Point] = []
    for p in points:
        if p.start and out and out[-1].start and out[-1].step == p.step:
            continue
        out.append(p)
    return out


def _alive_gaps(evs: Sequence[ev.Event]) -> list[tuple[float, float]]:
    """Intervals in which no agent of the run was alive (after the first one started)."""
    alive: set[tuple[str, int]] = set()
    gaps: list[tuple[float, float]] = []
    empty_since: float | None = None
    for e in evs:
        if isinstance(e, ev.AgentStart):
            if empty_since is not None:
                gaps.append((empty_since, e.time))
                empty_since = None
            alive.add((e.host, e.pid))
        elif isinstance(e, ev.AgentExit) and (e.host, e.pid) in alive:
            alive.discard((e.host, e.pid))
            if not alive:
                empty_since = e.time
    return gaps


class _ByKind:
    """The events of each kind in time order, to find those in ``(a, b]`` by bisection
    (a long run has many gaps and many events: no scan per gap)."""

    def __init__(self, evs: Sequence[ev.Event]) -> None:
        self._events: dict[type, list[ev.Event]] = {}
        for e in evs:
            self._events.setdefault(type(e), []).append(e)
        self._times = {k: [e.time for e in v] for k, v in self._events.items()}

    def within(self, a: float, b: float, *kinds: type) -> list[ev.Event]:
        out: list[ev.Event] = []
        for kind in kinds:
            times = self._times.get(kind, [])
            lo, hi = bisect.bisect_right(times, a), bisect.bisect_right(times, b)
            out += self._events[kind][lo:hi] if hi > lo else []
        return sorted(out, key=lambda e: e.time)


def _book_lost(
    out: Goodput, a: float, b: float, category: str, queue: list[tuple[float, float]]
) -> None:
    """Book a..b to ``category``, except the parts in which no agent was alive."""
    cursor = a
    for qa, qb in queue:
        lo, hi = max(qa, a), min(qb, b)
        if hi <= lo:
            continue
        out.add(cursor, lo, category)
        out.add(lo, hi, "queue wait")
        cursor = hi
    out.add(cursor, b, category)


def account(events: Iterable[ev.Event], now: float | None = None) -> Goodput:
    """Where the run's wall-clock time went (see the module docstring).

    Args:
        events: the run's events, ordered by time (:func:`slurm_elastic.events.read_events`).
        now: the end of a run that is still going (default: its last event).
    """
    evs = [e for e in events if not isinstance(e, ev.UnknownEvent)]
    out = Goodput()
    if not evs:
        return out
    out.start = evs[0].time
    out.end = max(evs[-1].time, now or evs[-1].time)
    queue = _alive_gaps(evs)
    points = _trace(evs)
    if not points:
        _book_lost(out, out.start, out.end, "start-up", queue)
        return out

    first = points[0]
    _book_lost(out, out.start, first.time, "start-up", queue)
    out.first_step = first.step
    done = first.step  # the highest step trained so far
    stalls = _Stalls(evs)
    index = _ByKind(evs)
    rounds: set[int] = set()  # the rounds switched into in place (each rank reports it)
    for a, b in itertools.pairwise(points):
        workers = index.within(a.time, b.time, ev.WorkersStarted)
        in_place = index.within(a.time, b.time, ev.AgentReformedInPlace, ev.LiveReformed)
        # the workers restarted in between (a newcomer's own start, while the others
        # switch in place, is not a restart of the world)
        if index.within(a.time, b.time, ev.AgentRestart) or (b.start and workers and not in_place):
            split = workers[0].time if workers else b.time
            _book_lost(out, a.time, split, "re-formation", queue)
            _book_lost(out, split, b.time, "restarts", queue)
            out.restarts += 1
            continue
        gap = b.time - a.time
        switch = 0.0
        for e in index.within(a.time, b.time, ev.LiveReformed, ev.LiveCollectiveAborted):
            if isinstance(e, ev.LiveReformed):
                switch = max(switch, e.switch_s)
            elif isinstance(e, ev.LiveCollectiveAborted):
                switch = max(switch, e.stalled_s)
        rounds.update(
            e.round
            for e in index.within(a.time, b.time, ev.LiveReformed)
            if isinstance(e, ev.LiveReformed)
        )
        switch = min(switch, gap)
        if b.step <= a.step:  # no step advanced: a switch (a rollback), or nothing named
            out.add(a.time, a.time + switch, "re-formation")
            out.add(a.time + switch, b.time, "other")
            continue
        stepping_start = a.time + switch
        out.add(a.time, stepping_start, "re-formation")
        stall = min(stalls.take(a.step, b.step), b.time - stepping_start)
        stepping = b.time - stepping_start - stall
        steps = b.step - a.step
        redone = max(0, min(b.step, done) - a.step)
        redone_s = stepping * redone / steps
        out.redone_steps += redone
        out.add(stepping_start, stepping_start + redone_s, "redone steps")
        out.add(stepping_start + redone_s, b.time - stall, "useful")
        out.add(b.time - stall, b.time, "checkpoint stalls")
        done = max(done, b.step)
    out.reformations = len(rounds)
    out.last_step = max(done, points[-1].step)
    _book_lost(out, points[-1].time, out.end, "wind-down", queue)
    return out


class _Stalls:
    """How long each step's save blocked training (the longest report for the step),
    taken once per step by the stretch of steps it falls in."""

    def __init__(self, evs: Sequence[ev.Event]) -> None:
        by_step: dict[int, float] = {}
        for e in evs:
            if isinstance(e, ev.CheckpointSaved):
                stall = e.stall_seconds if e.stall_seconds is not None else e.seconds
                by_step[e.step] = max(by_step.get(e.step, 0.0), max(0.0, stall))
        self._steps = sorted(by_step)
        self._by_step = by_step

    def take(self, first: int, stop: int) -> float:
        """The stalls of the saves at steps ``first`` <= step < ``stop`` (bisection: the
        steps come from files, a range over them could be astronomically long)."""
        lo = bisect.bisect_left(self._steps, first)
        hi = bisect.bisect_left(self._steps, stop)
        taken = sum(self._by_step[s] for s in self._steps[lo:hi])
        del self._steps[lo:hi]
        return taken


def render_goodput(run_id: str, g: Goodput) -> str:
    """The human-readable breakdown."""
    if g.start is None:
        return f"run {run_id}: no events, nothing to account\n"
    lines = [
        f"goodput of run {run_id}: {g.total_s:.1f} s wall-clock from the first agent's start, "
        + (
            "-"
            if g.efficiency is None
            else f"useful {g.seconds['useful']:.1f} s ({100 * g.efficiency:.1f}%)"
        ),
        "",
        f"{'':2}{'category':<18} {'seconds':>9} {'share':>7}",
    ]
    for name in CATEGORIES:
        secs = g.seconds[name]
        share = 100 * secs / g.total_s if g.total_s > 0 else 0.0
        lines.append(f"{'':2}{name:<18} {secs:>9.1f} {share:>6.1f}%")
    lines.append(f"{'':2}{'lost in all':<18} {g.lost_s:>9.1f}")
    lines.append("")
    lines.append(
        f"steps {g.first_step if g.first_step is not None else '-'} -> "
        f"{g.last_step if g.last_step is not None else '-'}, {g.redone_steps} redone; "
        f"{g.restarts} restart(s) of the workers, {g.reformations} in-place "
        "re-formation(s); "
        "queue wait before the first agent started is not in the events"
    )
    return "\n".join(lines) + "\n"
