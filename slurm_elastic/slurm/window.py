"""The preemption window: how long a task has between its notice and SIGKILL, and
whether a durable checkpoint save fits in it. Pure: numbers in, a verdict out.

Slurm gives a task three different warnings (verified on the local Slurm 22.05,
``docs/reliability.md``):

* **preemption** (``PreemptMode`` REQUEUE/CANCEL with ``GraceTime``): the notice (our
  ``--signal``, with ``SlurmctldParameters=preempt_send_user_signal``; else SIGTERM)
  comes at once, SIGTERM after the partition's ``GraceTime``, SIGKILL ``KillWait`` later:
  window = GraceTime + KillWait; the user cannot change either (site settings);
* **time limit**: the notice ``signal_lead_s`` before the limit (the template's
  ``--signal=B:USR2@<lead>``; Slurm may send it up to 60 s earlier), SIGTERM at the limit,
  SIGKILL ``KillWait`` later: window = lead + KillWait; ``signal_lead_s`` is the user's;
* **the agent's own budget**: after a notice the agent gives its workers
  ``shutdown_timeout_s`` to save and leave (a config key).

A save fits a window when it ends :data:`MARGIN_S` before the window does (the workers
must still stop, leave the rendezvous and requeue). The save time is the longest of the
last :data:`RECENT_SAVES` durable saves (``checkpoint.saved`` events, ``seconds``: from
the save call to the commit), so one slow save is not averaged away.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slurm_elastic.slurm.site import PartitionInfo, parse_duration_s

__all__ = [
    "MARGIN_S",
    "RECENT_SAVES",
    "NoticeWindow",
    "WindowCase",
    "WindowVerdict",
    "plan_window",
    "save_estimate",
    "window_from_site",
]

#: Seconds a window must keep after the save: stop the workers, leave, requeue.
MARGIN_S = 5.0
#: How many of the most recent saves the estimate looks at.
RECENT_SAVES = 5


@dataclass(frozen=True)
class NoticeWindow:
    """The warning settings one task runs under (``None``: not known).

    Attributes:
        signal_lead_s: the ``--signal`` lead of the job script.
        grace_time_s: the partition's ``GraceTime``.
        kill_wait_s: ``KillWait`` (``scontrol show config``).
        partition: the partition's name.
        preemptable: ``False`` when the partition's ``PreemptMode`` is ``OFF``.
    """

    signal_lead_s: float | None = None
    grace_time_s: float | None = None
    kill_wait_s: float | None = None
    partition: str | None = None
    preemptable: bool = True


@dataclass(frozen=True)
class WindowCase:
    """One way a task is warned, and how long it then has.

    Attributes:
        name: ``preemption``, ``time limit`` or ``agent budget``.
        seconds: from the notice to SIGKILL (to the agent's deadline for its budget).
        made_of: what it is made of (``GraceTime 20 s + KillWait 5 s (partition low)``).
        change: the setting to change when a save does not fit.
    """

    name: str
    seconds: float
    made_of: str
    change: str


@dataclass(frozen=True)
class WindowVerdict:
    """What :func:`plan_window` found.

    Attributes:
        save_s: the save time judged (``None``: no save measured yet).
        cases: every window that could be worked out.
        misfits: the cases the save does not fit (with :data:`MARGIN_S`).
        unknown: settings that could not be read (their case is left out).
    """

    save_s: float | None
    cases: tuple[WindowCase, ...]
    misfits: tuple[WindowCase, ...]
    unknown: tuple[str, ...]

    @property
    def fits(self) -> bool | None:
        """``True``/``False``; ``None`` while no save was measured."""
        return None if self.save_s is None else not self.misfits

    def summary(self) -> str:
        """One line for the agent's log and ``status`` (every window, then the verdict)."""
        windows = ", ".join(f"{c.name} {c.seconds:g} s ({c.made_of})" for c in self.cases)
        text = f"preemption window: {windows or 'unknown'}"
        if self.unknown:
            text += f"; not known: {', '.join(self.unknown)}"
        if self.save_s is None:
            return text + "; no checkpoint save measured yet"
        if not self.misfits:
            return text + f"; the checkpoint save ({self.save_s:.1f} s) fits"
        return text + "; " + "; ".join(self.problems())

    def problems(self) -> list[str]:
        """One sentence per window the save does not fit, naming the setting to change."""
        return [
            f"the checkpoint save takes {self.save_s:.1f} s, which does not fit the "
            f"{c.name} window of {c.seconds:g} s ({c.made_of}) with {MARGIN_S:g} s to "
            f"leave: {c.change}, or make the save faster"
            for c in self.misfits
        ]


def save_estimate(durations: Sequence[float], recent: int = RECENT_SAVES) -> float | None:
    """The longest of the last ``recent`` save durations (``None`` if there are none)."""
    last = [d for d in durations if d >= 0][-recent:]
    return max(last) if last else None


def plan_window(
    window: NoticeWindow, shutdown_timeout_s: float, save_s: float | None
) -> WindowVerdict:
    """Work out each window of ``window`` and whether ``save_s`` fits it.

    Args:
        window: the task's warning settings.
        shutdown_timeout_s: the agent's budget for the workers after a notice.
        save_s: the durable save time (:func:`save_estimate`), ``None`` if unmeasured.
    """
    cases: list[WindowCase] = []
    unknown: list[str] = []
    kill = window.kill_wait_s
    if kill is None:
        unknown.append("KillWait")
    where = f" (partition {window.partition})" if window.partition else ""
    if not window.preemptable:
        pass  # PreemptMode=OFF: nothing preempts this task
    elif window.grace_time_s is None:
        unknown.append("GraceTime")
    elif kill is not None:
        cases.append(
            WindowCase(
                "preemption",
                window.grace_time_s + kill,
                f"GraceTime {window.grace_time_s:g} s + KillWait {kill:g} s{where}",
                f"ask the site for a longer GraceTime on partition {window.partition or '?'} "
                f"(now {window.grace_time_s:g} s) or use a partition with a longer one",
            )
        )
    if window.signal_lead_s is None:
        unknown.append("the --signal lead (signal_lead_s)")
    else:
        lead, kill_part = window.signal_lead_s, (kill or 0.0)
        cases.append(
            WindowCase(
                "time limit",
                lead + kill_part,
                f"signal_lead_s {lead:g} s" + (f" + KillWait {kill:g} s" if kill else ""),
                f"raise signal_lead_s in the job file (now {lead:g} s)",
            )
        )
    cases.append(
        WindowCase(
            "agent budget",
            shutdown_timeout_s,
            f"shutdown_timeout_s {shutdown_timeout_s:g} s",
            f"raise shutdown_timeout_s (now {shutdown_timeout_s:g} s)",
        )
    )
    misfits = () if save_s is None else tuple(c for c in cases if save_s + MARGIN_S > c.seconds)
    return WindowVerdict(save_s, tuple(cases), misfits, tuple(unknown))


def window_from_site(
    site_config: Mapping[str, str],
    partitions: Sequence[PartitionInfo],
    partition: str | None,
    signal_lead_s: float | None,
) -> NoticeWindow:
    """The window from ``scontrol show config`` and ``show partition`` (parsed).

    ``partition`` is the task's (``SLURM_JOB_PARTITION``); ``None``: the default one.
    A partition's ``PreemptMode`` of ``OFF`` makes it not preemptable (a partition that
    shows none, or the cluster's ``PreemptType=preempt/none``, too).
    """
    chosen = next(
        (p for p in partitions if (p.name == partition if partition else p.default)), None
    )
    preempt_type = site_config.get("PreemptType", "")
    preemptable = not preempt_type.endswith("/none") and (
        chosen is None or chosen.preempt_mode.upper() not in ("OFF", "")
    )
    return NoticeWindow(
        signal_lead_s=signal_lead_s,
        grace_time_s=None if chosen is None else chosen.grace_time_s,
        kill_wait_s=parse_duration_s(site_config.get("KillWait")),
        partition=chosen.name if chosen is not None else partition,
        preemptable=preemptable,
    )
