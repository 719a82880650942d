"""``SlurmElasticAgent``: torch's ``LocalElasticAgent`` with the reactions Slurm jobs need.

Torch's monitor loop (``SimpleElasticAgent._invoke_run``, with its metrics) is used as
is; this class plugs into its intended extension points:

* ``_monitor_workers`` (torch: "override to return UNHEALTHY for a hang") adds
  1. **the hang watchdog**: with ``hang_timeout_s`` set, a group whose progress reports
     stop changing for that long (measured on this node's monotonic clock, see
     :mod:`~slurm_elastic.agent.watchdog`) is reported failed, and a stopped worker
     (SIGSTOP, a tracer) is SIGKILLed first (it would never act on torch's SIGTERM).
     A group whose workers all still run may only be waiting in a collective for a
     hung worker on another node: with peers, it first waits up to the eviction
     window for a membership change (that node restarting its workers) and, if one
     comes, re-forms in place instead (the other nodes stay);
  2. **a departing peer is not a failure**: a failed group waits up to the eviction
     window for the rendezvous to report a membership change; if one comes, the group
     is reported healthy and torch's own membership path restarts it (not charged to
     ``max_restarts``: no budget arithmetic here, torch's accounting is pinned by
     ``tests/agent/test_torch_agent_contract.py``); else torch charges the failure;
  3. **graceful leave in place**: after a preemption notice (:meth:`request_live_leave`)
     the agent leaves the rendezvous while its workers keep training; they exit at the
     switch of the survivors, then the agent stops through torch's signal path;
  4. **a lost stop is acted on**: the stop signal's ``SignalException`` is raised in
     whatever code the main thread ran, and code that catches ``Exception`` there
     swallows it (logging's handlers do); torch's loop monitors only while no stop is
     under way, so ``stop_check`` raises a stop seen at a tick again
     (:meth:`slurm_elastic.agent.stop.Stop.raise_if_lost`).
* ``_restart_workers`` is wrapped:
  1. **in place**: for a membership change (nothing failed locally) with workers that
     registered on the node channel (:mod:`slurm_elastic.live.roster`), the agent
     runs the new rendezvous round *without stopping its workers* and hands each worker
     its new rank, world size and the round's store address; the workers re-form their
     process group at a step boundary (:mod:`slurm_elastic.live`). A round that cannot
     form raises as torch's restart would; workers that cannot re-form exit non-zero
     and torch's restart runs (the fallback). If the round filled ``max_nodes`` without
     this node, it waits as a spare; its workers see the others' round ready without
     them, withdraw and leave at the switch, and new workers start if it is promoted.
  2. **notice before a restart**: a membership restart of workers that cannot re-form
     in place first gives them the preemption notice and waits for them to save and
     exit (``shutdown_timeout_s``), so a scale-up loses no step. Workers still starting
     (not registered as live) are not restarted for newcomers while no member was
     lost: the change waits for them to go live, at most ``shutdown_timeout_s`` after
     their start, then re-forms in place (:meth:`_defer_for_starting_workers`);
  3. **events** for restarts, re-formations, hangs and the end.

* ``_assign_worker_ranks`` reads the round's store through
  :class:`~slurm_elastic.agent.round_store.RoundBoundStore`: a member that dies after
  the round completed, before writing its rank info, breaks the round and the agent
  joins the next one (``_rendezvous`` retries) instead of waiting out the store timeout.

Everything else (rank computation, worker start/stop, the exit barrier, signal
forwarding, metrics) is torch's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any

from torch.distributed.elastic.agent.server.api import (
    RunResult,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.rendezvous.api import RendezvousHandler

from slurm_elastic import _startup_seam, events, notice, procstat
from slurm_elastic.agent.round_store import RoundBoundStore
from slurm_elastic.agent.warm_handler import warm_starts
from slurm_elastic.agent.warm_workers import WarmWorkers
from slurm_elastic.agent.watchdog import ProgressWatch
from slurm_elastic.channel import NodeChannel
from slurm_elastic.errors import RoundLostError
from slurm_elastic.live import roster
from slurm_elastic.rendezvous.protocols import (
    LeavableRendezvous,
    RoundReporting,
    RoundWatching,
    SeatKeeping,
)

__all__ = ["SlurmElasticAgent"]

log = logging.getLogger(__name__)


def _round_of(handler: RendezvousHandler) -> int:
    """The rendezvous round just joined, the same number on every node."""
    if isinstance(handler, RoundReporting) and handler.current_round is not None:
        return handler.current_round
    return _dynamic_handler_round(handler) or 0  # torch's c10d / etcd handlers


def _stopped(pids: Iterable[object]) -> list[int]:
    """The processes among ``pids`` that are stopped (SIGSTOP or a tracer): hung here."""
    return [
        pid for pid in pids if isinstance(pid, int) and (st := procstat.read(pid)) and st.stopped
    ]


def _dynamic_handler_round(handler: object) -> int | None:
    """The round held by torch's ``DynamicRendezvousHandler`` (c10d, etcd), else ``None``.

    Torch's handlers do not report their round publicly: this reads their private state
    holder, defensively (any change in torch gives ``None``, then round 0: in-place
    workers then only lose the stale-assignment check). Ours reports it
    (``RoundReporting``).
    """
    holder = getattr(handler, "_state_holder", None)
    state = getattr(holder, "state", None)
    value = getattr(state, "round", None)
    return value if isinstance(value, int) else None


class SlurmElasticAgent(LocalElasticAgent):
    """A per-node elastic agent.

    Args:
        membership_grace_s: how long a failed group waits for the rendezvous to report a
            membership change before its failure is charged to ``max_restarts``.
        progress: the watch over the workers' progress file.
        hang_timeout_s: fail the group after this long without progress; ``None`` = off.
        before_round: called before each rendezvous round that (re)starts the local
            workers, once the previous ones are stopped (the launcher clears the
            per-round notice, progress and channel files there).
        channel: the node channel (its notice is raised before a membership restart).
        notice_signal: the signal the workers handle as a notice.
        leave: called once to leave the rendezvous without closing it.
        leave_timeout_s: how long leaving workers may take to exit after the notice.
        kwargs: passed to :class:`LocalElasticAgent`.
    """

    def __init__(
        self,
        *,
        membership_grace_s: float,
        progress: ProgressWatch,
        hang_timeout_s: float | None,
        before_round: Callable[[WorkerGroup], None],
        channel: NodeChannel,
        notice_signal: signal.Signals,
        leave: Callable[[], None],
        leave_timeout_s: float,
        warm: WarmWorkers | None = None,
        stop_check: Callable[[], None] = lambda: None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._warm = warm
        self._stop_check = stop_check
        self._membership_grace_s = membership_grace_s
        self._progress = progress
        self._hang_timeout_s = hang_timeout_s
        self._before_round = before_round
        self._channel = channel
        self._notice_signal = notice_signal
        self._leave = leave
        self._leave_timeout_s = leave_timeout_s
        self._charged = False
        self._last_state = WorkerState.INIT
        self._leaving_since: float | None = None
        self._left = False
        self._loss_round = -1  # the newest round formed after a loss (Assignment.loss_round)
        self._workers_started_at: float | None = None  # monotonic, the last worker start
        self._deferring = False  # a membership change waits for them (logged once)
        self._own_group_script = False  # its workers make their own group (restart path)

    # -- rendezvous ---------------------------------------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        while True:
            try:
                super()._rendezvous(worker_group)
                _startup_seam.pause("rendezvous")  # tests only: a notice in a formed round
                return
            except RoundLostError as exc:
                log.warning(
                    "rendezvous round broken during rank assignment (%s): joining again", exc
                )

    def _assign_worker_ranks(
        self, store: Any, group_rank: int, group_world_size: int, spec: WorkerSpec
    ) -> list[Worker]:
        handler = spec.rdzv_handler
        if isinstance(handler, RoundWatching):
            store = RoundBoundStore(store, handler.round_lost)
        return super()._assign_worker_ranks(store, group_rank, group_world_size, spec)

    # -- worker start -------------------------------------------------------------------

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        self._before_round(worker_group)
        self._progress.reset()
        super()._initialize_workers(worker_group)
        self._announce_started(worker_group)

    def _announce_started(self, worker_group: WorkerGroup) -> None:
        nodes = worker_group.group_world_size or 0
        world = nodes * worker_group.spec.local_world_size
        log.info(
            "rendezvous complete: group_rank=%s group_world_size=%s world_size=%s",
            worker_group.group_rank,
            nodes,
            world,
        )
        events.emit(
            events.WorkersStarted(
                group_rank=worker_group.group_rank,
                group_world_size=nodes,
                world_size=world,
                restart_count=worker_group.spec.max_restarts - self._remaining_restarts,
                logs=self._worker_logs(worker_group),
            )
        )

    def _worker_logs(self, worker_group: WorkerGroup) -> dict[str, str]:
        """Global rank -> the worker's stdout file (for ``slurm-elastic logs``)."""
        stdouts = getattr(self._pcontext, "stdouts", None) or {}
        return {
            str(w.global_rank): str(stdouts[w.local_rank])
            for w in worker_group.workers
            if stdouts.get(w.local_rank)
        }

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        # The round number lets workers tell a later assignment from a stale one.
        os.environ[roster.ROUND_ENV] = str(_round_of(worker_group.spec.rdzv_handler))
        events.compact()  # the event files of this node's stopped workers: into its archive
        # The first start takes the interpreters that imported torch while the agent
        # joined; later ones (restarts) start cold, and nothing idle is kept for them.
        warm, self._warm = self._warm, None
        try:
            with warm_starts(warm):
                started = super()._start_workers(worker_group)
            self._workers_started_at = time.monotonic()
        finally:
            if warm is not None:
                warm.close()
        _startup_seam.pause("workers_start")  # tests only: a notice as the workers start
        return started

    # -- the monitor loop's extension point -------------------------------------------------

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._stop_check()  # a stop whose exception was swallowed: raise it again
        result = super()._monitor_workers(worker_group)
        state = result.state
        if self._leaving_since is not None:
            return self._monitor_leaving(result)
        timeout = self._hang_timeout_s
        age = (
            self._progress.age_s() if timeout is not None and state == WorkerState.HEALTHY else 0.0
        )
        local_hang = False
        if state == WorkerState.HEALTHY and timeout is not None and age > timeout:
            stopped = _stopped(w.id for w in worker_group.workers)
            peers = (worker_group.group_world_size or 1) > 1
            if not stopped and peers and age <= timeout + self._membership_grace_s:
                # Every local worker runs: they may wait in a collective for a hung worker
                # elsewhere, whose agent restarts it and leaves the round at once. Give
                # that a grace: the membership change then re-forms these in place
                # (torch's loop sees num_nodes_waiting() > 0; issue 22: the others stay).
                self._last_state = WorkerState.HEALTHY
                return result
            log.warning(
                "no training progress for %.1f s (hang_timeout_s=%s%s): restarting workers",
                age,
                self._hang_timeout_s,
                f"; stopped worker(s) {sorted(stopped)}" if stopped else "",
            )
            events.emit(events.AgentHang(progress_age_s=age))
            for pid in stopped:  # a stopped process never acts on torch's SIGTERM
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            handler = worker_group.spec.rdzv_handler
            if stopped and peers and isinstance(handler, LeavableRendezvous):
                # The hang is here: leave the round now, so the other nodes re-form (in
                # place) without waiting for this restart; it joins again as it restarts.
                handler.leave()
            local_hang = bool(stopped)  # this node's own failure: charged at once
            # FAILED, not UNHEALTHY: torch reports an UNHEALTHY result as not failed.
            result = RunResult(state=WorkerState.FAILED)
            state = result.state
        if state == WorkerState.FAILED and not local_hang and self._closed_before_exit(result):
            done = {w.global_rank: None for w in worker_group.workers}  # torch reads each
            result = RunResult(state=WorkerState.SUCCEEDED, return_values=done)
            state = result.state
        if state == WorkerState.FAILED:
            if not local_hang and self._membership_changes_within(self._membership_grace_s):
                # A peer left, died or joined: the survivors' collectives failed through
                # no fault of theirs. Reported as healthy, torch's own membership path
                # (num_nodes_waiting() > 0) restarts the group without charging
                # max_restarts; the restart is a full one (these workers exited).
                log.info("worker group failed while the membership changed: new round "
                         "(not charged to max_restarts)")  # fmt: skip
                result = RunResult(state=WorkerState.HEALTHY)
            else:
                self._charged = True
                if self._remaining_restarts <= 0:
                    events.emit(events.AgentGaveUp(max_restarts=worker_group.spec.max_restarts))
        elif state == WorkerState.SUCCEEDED:
            log.info("local workers finished; waiting for the other agents")
            events.emit(events.WorkersSucceeded())
        self._last_state = state
        return result

    def _closed_before_exit(self, result: RunResult) -> bool:
        """Every local worker finished and closed its session (its ``closed`` mark holds
        its pid), and the failures are deaths by a signal: torch's gloo teardown aborting
        an interpreter's exit now and then (SIGABRT; a group still referenced when the
        interpreter exits), and torch stopping the other workers after it (SIGTERM).
        Nothing of the training is lost: it finished; count the workers as finished."""
        pids = {w.local_rank: w.id for w in self._worker_group.workers}
        codes = [f.exitcode for f in result.failures.values()]
        if not pids or not codes or any(code >= 0 for code in codes):
            return False
        if any(roster.closed_pid(self._channel, r) != pid for r, pid in pids.items()):
            return False
        log.warning(
            "every worker finished and closed its session, then %s died of a signal while "
            "its interpreter exited (exit codes %s: torch's gloo teardown aborts now and "
            "then): counted as finished",
            sorted(f.pid for f in result.failures.values()),
            codes,
        )
        return True

    def _membership_changes_within(self, seconds: float) -> bool:
        handler = self._worker_group.spec.rdzv_handler
        deadline = time.monotonic() + seconds
        while True:
            if handler.num_nodes_waiting() > 0:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.2, seconds))

    # -- graceful leave in place -------------------------------------------------------------

    def request_live_leave(self) -> bool:
        """Start a graceful leave in place, if the workers can (call on a notice signal).

        Returns:
            True: the agent leaves the rendezvous at its next monitor tick while the
            workers train on until the survivors switch; it then stops through torch's
            signal path (``SignalException``). False: use the ordinary stop.
        """
        if self._leaving_since is not None:
            return True
        if self._last_state != WorkerState.HEALTHY or not self._workers_registered():
            return False
        self._leaving_since = time.monotonic()
        events.emit(events.AgentLeaveInPlace())
        return True

    def _monitor_leaving(self, result: RunResult) -> RunResult:
        if not self._left:
            self._left = True
            self._leave()
            log.info("left the rendezvous; workers train on until the survivors switch")
        waited = time.monotonic() - (self._leaving_since or 0.0)
        if result.state in (WorkerState.SUCCEEDED, WorkerState.FAILED):
            log.info("leaving workers exited (%s) after %.2f s", result.state.name, waited)
            raise SignalException("leaving in place", sigval=self._notice_signal)
        if waited > self._leave_timeout_s:
            log.warning("leaving workers still running after %.1f s: stopping them", waited)
            raise SignalException("leave timed out", sigval=self._notice_signal)
        return RunResult(state=WorkerState.HEALTHY)

    # -- restarts ---------------------------------------------------------------------------

    def _workers_registered(self, *, live: bool = True) -> bool:
        """Whether every local worker registered with its pid as live (or as starting)."""
        if not roster.in_place_enabled():
            return False
        pids = {w.local_rank: w.id for w in self._worker_group.workers}
        return bool(pids) and roster.registered_workers(self._channel, live=live) == pids

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        charged, self._charged = self._charged, False
        if self._leaving_since is not None:
            return  # this node left: no new round for it
        membership = not charged and self._last_state == WorkerState.HEALTHY
        if membership and self._workers_registered():
            self._deferring = False
            self._reform_in_place(worker_group)  # emits agent.reformed_in_place
            return
        if membership and self._defer_for_starting_workers(worker_group):
            return  # torch's loop asks again at its next monitor tick
        self._deferring = False
        events.emit(
            events.AgentRestart(
                reason="membership" if not charged else "failure",
                remaining_restarts=self._remaining_restarts,
            )
        )
        if membership and self._workers_registered(live=False):
            # still joining their first group (perhaps blocked on the member that was
            # lost): no step trained, nothing to save, so no wait for a save
            log.info("workers still starting (no step trained): restarting them at once")
        elif membership:
            self._notice_before_restart(worker_group)
        super()._restart_workers(worker_group)

    def _defer_for_starting_workers(self, worker_group: WorkerGroup) -> bool:
        """Whether a membership restart waits for workers that are still starting.

        Newcomers are waiting, no member was lost, and this node's workers (healthy,
        started less than ``shutdown_timeout_s`` ago) have not registered as live yet:
        they are joining the round their agent formed, or not even there (importing,
        building the model). Restarting them now would give them the notice while they
        join: ``ElasticSession`` workers then train in place, voting to leave, and wait
        for a new round that this agent, waiting for them to exit, never joins (both
        waits ran out after 60 s and the members redid a step: issue 20's seat test).
        Once they are live, the change re-forms in place; the newcomers wait until then.
        A script without ``ElasticSession`` never registers: once a warm worker of it made
        its process group (:meth:`_script_makes_its_own_group`), or past the window
        (measured from its workers' start), it gets the notice and the restart as before.
        """
        if not roster.in_place_enabled():
            return False
        # read before the restart clears the marks, at every change: later starts are cold
        own_group = self._script_makes_its_own_group(worker_group)
        handler = worker_group.spec.rdzv_handler
        started = self._workers_started_at
        if (
            own_group
            or started is None
            or time.monotonic() - started > self._leave_timeout_s
            or not isinstance(handler, RoundWatching)
            # a member left or died (they may be blocked on it), unless the round only
            # moved on because a member re-joined in place for the newcomers
            or (handler.round_lost() and not handler.round_moved_on_in_place())
        ):
            return False
        if not self._deferring:
            self._deferring = True
            log.info(
                "nodes wait to join while the local workers are still starting: the change "
                "waits for them to go live (in place), at most %.0f s after their start (a "
                "script without ElasticSession: until it makes its process group, or that "
                "long when its workers started cold; %s=0 takes the restart path at once)",
                self._leave_timeout_s,
                roster.IN_PLACE_ENV,
            )
        return True

    def _script_makes_its_own_group(self, worker_group: WorkerGroup) -> bool:
        """Whether the workers' script makes its own process group (no ``ElasticSession``
        in place): one of them marked it (warm-started workers do:
        :func:`~slurm_elastic.live.roster.watch_for_restart_path`). Remembered while this
        agent runs: every start runs the same script (restarts start cold, unmarked)."""
        if not self._own_group_script:
            pids = {w.local_rank: w.id for w in worker_group.workers}
            if any(roster.restart_path_pid(self._channel, r) == p for r, p in pids.items()):
                self._own_group_script = True
                log.info(
                    "the local workers' script makes its own process group (no ElasticSession "
                    "in place): nodes that come restart it at once, after the notice"
                )
        return self._own_group_script

    def _reform_in_place(self, worker_group: WorkerGroup) -> None:
        started = time.monotonic()
        pids = {w.local_rank: w.id for w in worker_group.workers}
        handler = worker_group.spec.rdzv_handler
        seat = (
            handler.keeping_seat() if isinstance(handler, SeatKeeping) else contextlib.nullcontext()
        )
        # A member left or was evicted (not only a newcomer waiting): workers blocked in
        # a collective on a silently dead member may abort it (live/abort.py).
        after_loss = isinstance(handler, RoundWatching) and handler.round_lost()
        with seat:  # newcomers must not take every seat while these workers train
            self._rendezvous(worker_group)  # the workers keep training meanwhile
        events.compact()  # files of this node's gone processes (e.g. an agent that left)
        if roster.registered_workers(self._channel) != pids:
            # They withdrew while this node waited for a place: the round the others
            # switched to filled max_nodes without it (it waited as a spare), so they
            # left at that switch. This round has a place: start new workers in it.
            log.info("local workers left while this node waited as a spare: starting new ones")
            self._stop_workers(worker_group)
            self._before_round(worker_group)
            self._progress.reset()
            for local_rank, pid in self._start_workers(worker_group).items():
                worker_group.workers[local_rank].id = pid
            worker_group.state = WorkerState.HEALTHY
            self._announce_started(worker_group)
            return
        for worker in worker_group.workers:
            worker.id = pids[worker.local_rank]  # same processes, new ranks
        round_ = _round_of(worker_group.spec.rdzv_handler)
        if after_loss:
            self._loss_round = round_
        for worker in worker_group.workers:
            roster.write_assignment(
                self._channel,
                roster.Assignment(
                    round=round_,
                    rank=worker.global_rank,
                    world_size=worker.world_size,
                    local_rank=worker.local_rank,
                    group_rank=worker_group.group_rank or 0,
                    group_world_size=worker_group.group_world_size or 0,
                    master_addr=str(worker_group.master_addr),
                    master_port=int(worker_group.master_port or 0),
                    after_loss=after_loss,
                    loss_round=self._loss_round,
                ),
            )
        worker_group.state = WorkerState.HEALTHY
        self._progress.reset()  # the hang watch re-arms at the first step of the new round
        world = (worker_group.group_world_size or 0) * worker_group.spec.local_world_size
        log.info(
            "new round %d formed in place in %.2f s: group_rank=%s world_size=%s",
            round_,
            time.monotonic() - started,
            worker_group.group_rank,
            world,
        )
        events.emit(
            events.AgentReformedInPlace(
                round=round_,
                group_rank=worker_group.group_rank or 0,
                group_world_size=worker_group.group_world_size or 0,
                world_size=world,
            )
        )

    def _notice_before_restart(self, worker_group: WorkerGroup) -> None:
        """Give running workers the preemption notice and wait for them to save and exit."""
        pcontext = self._pcontext
        if pcontext is None:
            return
        notice.raise_notice(self._channel, reason="restart")
        for pid in pcontext.pids().values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, self._notice_signal)
        deadline = time.monotonic() + self._leave_timeout_s
        while time.monotonic() < deadline:
            result = pcontext.wait(0)
            if result is not None:
                codes = [f.exitcode for f in result.failures.values()]
                if codes and all(code == -int(self._notice_signal) for code in codes):
                    # no handler yet: still starting (importing torch), nothing trained
                    log.info("workers ended by the notice signal before they handled it")
                else:
                    log.info("workers saved and exited before the membership restart")
                return
            time.sleep(0.05)
        log.warning("workers did not exit within %.1f s of the notice", self._leave_timeout_s)
