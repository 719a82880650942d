"""Stopping the agent: the signals that ask it to stop, and the exit that follows.

The notice signal (``preempt_signal``, USR2 by default) and Slurm's SIGTERM/SIGHUP/SIGQUIT
raise the node's notice file at once (the workers read it even before the forwarded
signal arrives). Where the workers can, the node then leaves in place: they train on
until the survivors switch, then exit. Otherwise a :class:`SignalException` makes torch's
agent forward the notice signal and wait ``shutdown_timeout_s`` for the workers'
checkpoint; :func:`exit_after_signal` then leaves the rendezvous *without closing it*
and requeues the node's own task when the policy allows (:mod:`.requeue`).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from types import FrameType

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousHandler

from slurm_elastic import events, notice, signals
from slurm_elastic.agent.exit_codes import ExitCode
from slurm_elastic.agent.requeue import requeue_own
from slurm_elastic.channel import NodeChannel
from slurm_elastic.config import ElasticConfig
from slurm_elastic.errors import SlurmError
from slurm_elastic.rendezvous.protocols import LeavableRendezvous
from slurm_elastic.slurm.control import SlurmControl
from slurm_elastic.slurm.env import SlurmEnv

__all__ = [
    "Stop",
    "act_on_early_signals",
    "exit_after_signal",
    "install_stop_handlers",
    "leave_rendezvous",
]

log = logging.getLogger(__name__)


class Stop:
    """What asked the agent to stop; set from signal handlers (main thread only)."""

    def __init__(self, notice_signal: signal.Signals, channel: NodeChannel) -> None:
        self.notice_signal = notice_signal
        self.channel = channel
        #: the signals whose handler this is
        self.handled = frozenset({notice_signal, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT})
        self.noticed = False  # preemption/time-limit notice seen
        self.stopping = False  # a SignalException is already on its way
        self.signals: list[str] = []
        #: set once the agent exists: starts a graceful leave in place, if possible
        self.leave_in_place: Callable[[], bool] | None = None
        self.leaving_in_place = False

    def handler(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        self.signals.append(sig.name)
        if sig == self.notice_signal:
            self.noticed = True
        # Workers learn of it from the file even before the forwarded signal arrives.
        notice.raise_notice(self.channel, reason=sig.name)
        if self.stopping:
            return  # e.g. Slurm's SIGTERM after the USR2 notice: already shutting down
        # A notice, or Slurm's SIGTERM at preemption (KillWait follows): leave in place
        # when the workers can, so the survivors re-form without waiting for them.
        if (
            sig in (self.notice_signal, signal.SIGTERM)
            and not self.leaving_in_place
            and self.leave_in_place is not None
            and self.leave_in_place()
        ):
            # The workers train on until the survivors switch, then exit; the agent
            # then stops through the ordinary path. A second signal escalates.
            self.leaving_in_place = True
            log.warning("received %s: leaving in place (workers exit at the switch)", sig.name)
            events.emit(events.AgentSignal(signal=sig.name, notice=self.noticed, in_place=True))
            return
        self.stopping = True
        log.warning("received %s: stopping workers (they checkpoint first)", sig.name)
        events.emit(events.AgentSignal(signal=sig.name, notice=self.noticed))
        # torch's agent forwards ``sigval`` to the workers and waits shutdown_timeout_s:
        # forward the notice signal, which workers handle (checkpoint, then exit), even
        # for SIGTERM, whose default action would kill them before they can save.
        raise SignalException(f"agent {os.getpid()} got {sig.name}", sigval=self.notice_signal)

    def raise_if_lost(self) -> None:
        """Raise the stop again if its :class:`SignalException` was lost (the agent's
        monitor tick calls this).

        The handler raises in whatever code the main thread was running, and code that
        catches ``Exception`` there swallows it: the logging module's handlers do
        (``StreamHandler.emit``; measured: 19 of 20 signals that came while a record was
        written were lost). torch's loop only monitors while no stop is under way, so a
        stop seen at a tick was lost; without this the agent trained on, stopping
        nothing and requeueing nothing.
        """
        if not self.stopping:
            return
        log.warning(
            "the stop on %s was caught by the code it interrupted; acting on it now",
            self.signals[-1] if self.signals else "a signal",
        )
        raise SignalException(
            f"agent {os.getpid()} got {'/'.join(self.signals)}", sigval=self.notice_signal
        )


def install_stop_handlers(
    notice_signal: signal.Signals, channel: NodeChannel
) -> tuple[Stop, list[signal.Signals]]:
    """Take over the notice signal and SIGTERM/SIGHUP/SIGQUIT (main thread only).

    Returns:
        The :class:`Stop` their handler fills, and the signals held since start-up
        (:func:`slurm_elastic.signals.hold_early_notices`) for the caller to act on once
        it can handle the :class:`SignalException` that acting raises.
    """
    stop = Stop(notice_signal, channel)
    for sig in stop.handled:
        signal.signal(sig, stop.handler)
    early = signals.take_early_notices(stop.handled)
    # The job script may start the agent with the notice blocked (held pending until
    # now): from here on the handler acts on it.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop.handled)
    return stop, early


def act_on_early_signals(stop: Stop, early: list[signal.Signals]) -> None:
    """Handle the signals that came during start-up now (raises :class:`SignalException`)."""
    for sig in early:
        if sig in stop.handled:
            log.warning("%s arrived while the agent was starting: acting on it now", sig.name)
            stop.handler(sig, None)
        else:
            log.warning("ignored %s during start-up: not the notice signal", sig.name)


def leave_rendezvous(handler: RendezvousHandler | None) -> None:
    """Leave the rendezvous without closing it, when the backend can (ours can)."""
    if not isinstance(handler, LeavableRendezvous):
        return  # torch's backends: peers evict this node after the keep-alive window
    try:
        handler.leave()
    except (RendezvousError, OSError) as exc:
        log.warning("could not leave the rendezvous gracefully: %s", exc)


def exit_after_signal(
    config: ElasticConfig,
    slurm: SlurmEnv,
    client: SlurmControl | None,
    handler: RendezvousHandler | None,
    stop: Stop,
) -> ExitCode:
    """Leave the rendezvous and requeue as the policy says, once the workers are stopped.

    Returns:
        TERMINATED (no notice came, only an ending signal), PREEMPTED or
        PREEMPTED_REQUEUED.
    """
    # torch's agent has already forwarded the signal and waited up to
    # shutdown_timeout_s for the workers (their checkpoint flush), then killed them.
    stop.stopping = True  # from here on, signals are only recorded (no second exception)
    leave_rendezvous(handler)
    if not stop.noticed:
        events.emit(events.AgentTerminated(signals=list(stop.signals)))
        return ExitCode.TERMINATED
    if config.requeue == "never":
        return ExitCode.PREEMPTED
    outcome = requeue_own(config, slurm, client)
    if outcome is True:
        return ExitCode.PREEMPTED_REQUEUED
    if outcome is not False:
        _wait_for_slurm(stop, slurm, outcome)
    return ExitCode.PREEMPTED


#: Signals with which Slurm ends a task (preemption, time limit, scancel, requeue).
_ENDING = frozenset({"SIGTERM", "SIGHUP", "SIGQUIT"})


def _wait_for_slurm(stop: Stop, slurm: SlurmEnv, error: SlurmError) -> None:
    """The task could not requeue itself: stay until Slurm ends it, then exit.

    Exiting now would end the task as finished: during a preemption's GraceTime, Slurm
    then has nothing left to requeue (PreemptMode=REQUEUE only requeues a task it stops
    itself). Staying lets Slurm's own SIGTERM, at the end of the grace time or at the time
    limit, end the task as Slurm decides: requeued on a preemption. The workers are
    stopped and the rendezvous left already; a SIGTERM that came with the notice (e.g.
    GraceTime=0) ends the wait at once. Slurm's SIGKILL after KillWait is the backstop.
    """
    log.error(
        "cannot requeue %s myself (%s); waiting for Slurm to end this task: a preemption "
        "requeues it (PreemptMode=REQUEUE), a time limit or scancel ends it. To requeue on "
        "every notice, make scontrol reachable in the job (e.g. bind Slurm's commands "
        "into the container and put them on PATH in the job's setup)",
        slurm.own_job_ref,
        error,
    )
    while not _ENDING.intersection(stop.signals):
        time.sleep(0.2)  # the signal handler records Slurm's signal in stop.signals
    log.info("Slurm ended the task (%s)", ", ".join(stop.signals))
