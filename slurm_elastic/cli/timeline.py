"""``slurm-elastic timeline JOB -o timeline.png``: one picture of a run.

Three panels sharing the time axis (minutes since the run's first event):

1. **membership**: a lane per node; a bar while the node's workers are in the training
   world (coloured by the world's size in nodes), marks for restarts, preemption
   notices, requeues, evictions and hangs, and a thin line per committed checkpoint;
2. **world size** (nodes) over time;
3. **throughput** (steps/s from the training's progress reports);
4. **where the time went** (``status --goodput``, :mod:`slurm_elastic.cli.goodput`): one
   band coloured by what each stretch of wall-clock time was spent on, the seconds of
   each category in the legend.

Needs matplotlib (the ``plot`` extra: ``pip install 'slurm-elastic[plot]'``).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, TextIO

from slurm_elastic.cli.goodput import CATEGORIES, Goodput, account
from slurm_elastic.cli.runs import locate
from slurm_elastic.cli.summary import RunSummary
from slurm_elastic.cli.untrusted import printable
from slurm_elastic.errors import SlurmElasticError
from slurm_elastic.slurm.commands import SlurmClient

__all__ = ["draw_timeline", "run_timeline"]

_MARKS = {  # what -> (marker, colour, label)
    "restart": ("o", "#ff7f0e", "worker restart"),
    "preempt": ("v", "#d62728", "preemption notice"),
    "requeue": ("^", "#9467bd", "requeued"),
    "evicted": ("X", "#000000", "evicted (process gone, heartbeats lost, or unreachable)"),
    "hang": ("s", "#8c564b", "hang detected"),
}


_GOODPUT_COLOURS = dict(
    zip(
        CATEGORIES,
        (
            "#2ca02c",  # useful
            "#7f7f7f",  # queue wait
            "#1f77b4",  # start-up
            "#ff7f0e",  # re-formation
            "#d62728",  # restarts
            "#9467bd",  # redone steps
            "#8c564b",  # checkpoint stalls
            "#c7c7c7",  # wind-down
            "#e377c2",  # other
        ),
        strict=True,
    )
)


def _world_colour(nodes: int, most: int) -> Any:
    import matplotlib

    cmap = matplotlib.colormaps["viridis"]
    return cmap(0.1 + 0.8 * (nodes / max(1, most)))


def draw_timeline(
    s: RunSummary, output: str | os.PathLike[str], goodput: Goodput | None = None
) -> None:
    """Draw the timeline of a summarized run into ``output`` (PNG, SVG, PDF by suffix).

    ``goodput`` (the run's :func:`~slurm_elastic.cli.goodput.account`) adds the panel of
    where the time went.

    Host names, run ids and states come from the run's files: they are drawn literally
    (no ``$...$`` mathtext, which raises on a name it cannot parse; control characters
    escaped).

    Raises:
        SlurmElasticError: matplotlib is missing, or the run has no events.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SlurmElasticError(
            "timeline needs matplotlib: pip install 'slurm-elastic[plot]'"
        ) from exc
    with plt.rc_context({"text.parse_math": False}):
        _draw(s, output, goodput)


@dataclass(frozen=True)
class _Frame:
    """The time axis and the scale every panel shares."""

    t0: float  # the run's first event (Unix seconds)
    end: float  # its last one, or now while it runs
    most: int  # the largest world, in nodes (the colour scale)

    @property
    def span_min(self) -> float:
        return max((self.end - self.t0) / 60.0, 1e-3)

    def m(self, t: float) -> float:
        """Minutes since the run's first event."""
        return (t - self.t0) / 60.0


_LANE_H = 0.6


def _draw(s: RunSummary, output: str | os.PathLike[str], goodput: Goodput | None) -> None:
    """The figure: one panel per view of the run, sharing the time axis."""
    import matplotlib.pyplot as plt

    if s.started is None:
        raise SlurmElasticError(
            f"run {s.run_id} has no events yet ({s.events_dir}); nothing to draw"
        )
    frame = _Frame(
        t0=s.started,
        end=s.ended if s.ended is not None else s.now,
        most=max([n for _, n in s.world_series] + [1]),
    )
    nodes = len(s.nodes)
    fig_h = 2.4 + 0.45 * max(nodes, 1) + 3.2 + (0.9 if goodput is not None else 0.0)
    ratios = [max(2.0, 0.55 * nodes + 0.8), 1.2, 1.4] + ([0.7] if goodput else [])
    fig, axes = plt.subplots(
        len(ratios),
        1,
        sharex=True,
        figsize=(11, fig_h),
        gridspec_kw={"height_ratios": ratios},
    )
    title = printable(f"run {s.run_id}: {s.state}, {frame.span_min:.1f} min")
    if s.step is not None:
        title += f", step {s.step}" + (f"/{s.total_steps}" if s.total_steps else "")
    fig.suptitle(title, fontsize=13, fontweight="bold")
    _draw_membership(axes[0], s, frame)
    _draw_world_size(axes[1], s, frame)
    _draw_throughput(axes[2], s, frame)
    last = axes[2]
    if goodput is not None and goodput.start is not None:
        last = axes[3]
        _draw_goodput(last, goodput, frame)
    last.set_xlabel("minutes since the run started")
    last.set_xlim(-frame.span_min * 0.01, frame.span_min * 1.01)
    fig.tight_layout()
    fig.savefig(output, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _draw_membership(ax_n: Any, s: RunSummary, frame: _Frame) -> None:
    """Panel 1: a lane per node, a bar while it is in the world, marks for what happened."""
    m, end, span_min = frame.m, frame.end, frame.span_min
    nodes = list(s.nodes.values())
    labels = []
    for i, node in enumerate(nodes):
        y = len(nodes) - 1 - i
        label = (
            printable(node.key)
            if node.name in ("", *node.key.split(":"))
            else f"{printable(node.key)}\n({printable(node.name)})"
        )
        labels.append((y, label))
        for iv in node.intervals:
            stop = iv.end if iv.end is not None else end
            ax_n.broken_barh(
                [(m(iv.start), max(m(stop) - m(iv.start), span_min / 400))],
                (y - _LANE_H / 2, _LANE_H),
                facecolors=_world_colour(iv.world_nodes, frame.most),
                edgecolor="white",
                linewidth=0.5,
            )
    used = _draw_marks(
        ax_n, s, frame, {node.key: len(nodes) - 1 - i for i, node in enumerate(nodes)}
    )
    ax_n.set_yticks([y for y, _ in labels], [lab for _, lab in labels], fontsize=9)
    ax_n.set_ylim(-0.8, len(nodes) - 0.2 + 0.35)
    ax_n.set_title("nodes: in the training world (colour = world size)", loc="left", fontsize=10)
    ax_n.grid(axis="x", alpha=0.3)
    _membership_legend(ax_n, s, frame, used)


def _draw_marks(ax_n: Any, s: RunSummary, frame: _Frame, key_y: dict[str, int]) -> set[str]:
    """The marks above the lanes and a line per checkpoint; returns the kinds drawn."""
    used = set()
    for when, key, what in s.marks:
        if what == "checkpoint":
            ax_n.axvline(frame.m(when), color="#2ca02c", alpha=0.35, linewidth=0.8, zorder=0)
            continue
        if key not in key_y or what not in _MARKS:
            continue
        marker, colour, _ = _MARKS[what]
        ax_n.plot(
            frame.m(when),
            key_y[key] + _LANE_H / 2 + 0.12,
            marker=marker,
            color=colour,
            markersize=9,
            markeredgecolor="white",
            linestyle="none",
            zorder=5,
        )
        used.add(what)
    return used


def _membership_legend(ax_n: Any, s: RunSummary, frame: _Frame, used: set[str]) -> None:
    """The legend of panel 1: the world sizes seen, the marks drawn, the checkpoints."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    nodes = s.nodes.values()
    handles: list[Any] = [
        Patch(facecolor=_world_colour(n, frame.most), label=f"world of {n} node(s)")
        for n in sorted({iv.world_nodes for node in nodes for iv in node.intervals})
    ]
    handles += [
        Line2D(
            [],
            [],
            marker=_MARKS[w][0],
            color=_MARKS[w][1],
            linestyle="none",
            markersize=8,
            label=_MARKS[w][2],
        )
        for w in _MARKS
        if w in used
    ]
    if s.checkpoints:
        handles.append(
            Line2D([], [], color="#2ca02c", alpha=0.6, label=f"checkpoint ({len(s.checkpoints)})")
        )
    ax_n.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False
    )


def _draw_world_size(ax_w: Any, s: RunSummary, frame: _Frame) -> None:
    """Panel 2: the world size in nodes over time."""
    from matplotlib.ticker import MaxNLocator

    if s.world_series:
        xs = [frame.m(t) for t, _ in s.world_series] + [frame.m(frame.end)]
        ys = [n for _, n in s.world_series] + [s.world_series[-1][1]]
        ax_w.step(xs, ys, where="post", color="#1f77b4", linewidth=2)
        ax_w.fill_between(xs, ys, step="post", alpha=0.15, color="#1f77b4")
    ax_w.set_ylabel("nodes")
    ax_w.set_ylim(0, frame.most + 0.6)
    ax_w.yaxis.set_major_locator(MaxNLocator(integer=True))  # not one tick per node
    ax_w.set_title("world size", loc="left", fontsize=10)
    ax_w.grid(alpha=0.3)


def _draw_throughput(ax_t: Any, s: RunSummary, frame: _Frame) -> None:
    """Panel 3: steps/s from the training's progress reports."""
    if s.throughput_series:
        xs = [frame.m(t) for t, _ in s.throughput_series]
        rates = [v for _, v in s.throughput_series]
        ax_t.plot(xs, rates, color="#ff7f0e", marker=".", linewidth=1.2)
        finite = [r for r in rates if math.isfinite(r)]  # NaN marks a worker restart: a gap
        ax_t.set_ylim(0, max([*finite, 1e-9]) * 1.2)
    else:
        ax_t.text(
            0.5,
            0.5,
            "no progress reports (emit events.TrainProgress from the training loop)",
            ha="center",
            va="center",
            transform=ax_t.transAxes,
            color="grey",
        )
    ax_t.set_ylabel("steps/s")
    ax_t.set_title("throughput", loc="left", fontsize=10)
    ax_t.grid(alpha=0.3)


def _draw_goodput(ax: Any, goodput: Goodput, frame: _Frame) -> None:
    """Panel 4: one band coloured by what each stretch of time was spent on."""
    from matplotlib.patches import Patch

    m = frame.m
    for cat in CATEGORIES:
        bars = [
            (m(sp.start), m(sp.end) - m(sp.start)) for sp in goodput.spans if sp.category == cat
        ]
        if bars:
            ax.broken_barh(bars, (0, 1), facecolors=_GOODPUT_COLOURS[cat])
    ax.set_yticks([])
    ax.set_ylim(0, 1)
    ax.set_title(
        f"where the time went (status --goodput): useful {goodput.seconds['useful']:.0f} s"
        f" of {goodput.total_s:.0f} s",
        loc="left",
        fontsize=10,
    )
    ax.legend(
        handles=[
            Patch(facecolor=_GOODPUT_COLOURS[c], label=f"{c} {goodput.seconds[c]:.1f} s")
            for c in CATEGORIES
            if goodput.seconds[c] > 0
        ],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.3),
        fontsize=7,
        frameon=False,
    )


def run_timeline(
    job: str,
    output: str,
    *,
    client: SlurmClient | None = None,
    out: TextIO | None = None,
) -> int:
    """``slurm-elastic timeline``; returns the exit status (0).

    Raises:
        RunNotFoundError: ``job`` names no run.
        SlurmElasticError: no matplotlib, no events, or ``output``'s directory is missing.
    """
    from slurm_elastic.cli.status import collect

    directory = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(directory):
        raise SlurmElasticError(
            f"-o {output!r}: directory {directory!r} does not exist; create it or choose "
            "another path"
        )
    from slurm_elastic import events as ev

    location = locate(job, client)
    summary = collect(location, client)
    goodput = account(
        ev.read_events(location.events_dir), now=None if summary.ended is not None else summary.now
    )
    draw_timeline(summary, output, goodput)
    stream = sys.stdout if out is None else out
    stream.write(f"{os.path.abspath(output)}\n")
    return 0
