"""``SlurmRendezvousHandler``: torch's rendezvous state machine, fixed where it is wrong.

Reused from ``torch.distributed.elastic.rendezvous.dynamic_rendezvous`` (2.13): the join,
exit and close operations (min/max nodes, last call, join timeout, wait list, hot
spares in the redundancy list, rank assignment) and the compare-and-set state holder.

Changed, and why:

* **State** in :class:`~slurm_elastic.rendezvous.backend.FileRendezvousBackend` on the
  shared filesystem: no store host to lose.
* **Heartbeats** are counters watched around a ring
  (:mod:`~slurm_elastic.rendezvous.heartbeat`) by a thread that runs for the handler's
  whole life (also while waiting as a spare); torch's wall-clock keep-alive is switched
  off (its interval is set to years and its ``_sanitize`` does nothing). Dead nodes are
  evicted by a compare-and-set written by their watcher.
* **Prompt restart**: :meth:`num_nodes_waiting` is also positive when a participant of
  this node's round is gone (left or evicted), when the run was closed, or when this
  node itself was evicted, so torch's agent restarts its workers at once.
* **Graceful leave**: :meth:`leave` removes this node from the state without closing the
  run (called by our agent on preemption, and at interpreter exit if neither
  :meth:`shutdown` nor :meth:`leave` ran, e.g. torchrun exiting on SIGTERM).
* **Polling**: torch waits a fixed 1 s between polls; here a waiting node polls the
  cheap ``head`` pointer with a backoff from ``poll_interval`` to 0.25 s and re-reads the
  state as soon as its generation changes; a node that lost a compare-and-set backs off
  a random few milliseconds (fewer collisions when many nodes start at once).
* **Members seated first** (in place, inside :meth:`SlurmRendezvousHandler.keeping_seat`):
  a member re-joining from its completed round reopens it
  as the next round with all its participants seated (one compare-and-set,
  :class:`~slurm_elastic.rendezvous.executor.ReseatExitOp`) instead of torch's
  exit-then-join, so newcomers get only the remaining seats and a node whose workers
  still train is never left out by them; a waiting node that finds the round complete
  and full waits as a spare (redundancy list) instead of making members re-form, and
  until it moves there the members do not count it as waiting. A member that restarts
  (exit-then-join) and finds itself seated in the next round by another member takes
  that seat instead of leaving it.
* **Workers' store**: owned per round by
  :class:`~slurm_elastic.rendezvous.worker_store.WorkerStoreOwner`.
* **Requeue safety**: the epoch is chosen by
  :meth:`~slurm_elastic.rendezvous.run_directory.RunDirectory.select_epoch`.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousError,
    RendezvousInfo,
)

from slurm_elastic import events
from slurm_elastic.rendezvous.backend import BACKEND_NAME
from slurm_elastic.rendezvous.executor import (
    CounterStateHolder,
    LeaveOp,
    PollingOpExecutor,
    ReformJoinOp,
    ReseatExitOp,
)
from slurm_elastic.rendezvous.heartbeat import HeartbeatMonitor, node_file_name
from slurm_elastic.rendezvous.join_intents import (
    IntentBoard,
)
from slurm_elastic.rendezvous.options import RendezvousOptions
from slurm_elastic.rendezvous.run_directory import Epoch, Incarnation
from slurm_elastic.rendezvous.torch_compat import (
    DynamicRendezvousHandler,
    RendezvousSettings,
    RendezvousTimeout,
    _NodeDesc,
    _remove_participant_epilogue,
    _RendezvousState,
)
from slurm_elastic.rendezvous.worker_store import RoundLostError, WorkerStoreOwner

__all__ = ["SlurmRendezvousHandler"]

log = logging.getLogger(__name__)

# Torch's keep-alive is replaced by counter heartbeats: an interval this long means
# torch never decides a keep-alive is due.
_NEVER = timedelta(days=3650)


def _members_digest(participants: dict[_NodeDesc, int]) -> str:
    """A digest of a round's members and ranks (rank 0 publishes it with the store)."""
    text = ",".join(f"{n!r}={r}" for n, r in sorted(participants.items(), key=lambda x: x[1]))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _leave_at_exit(ref: weakref.ReferenceType[SlurmRendezvousHandler]) -> None:
    handler = ref()
    if handler is not None:
        handler._leave_if_active()


class SlurmRendezvousHandler(DynamicRendezvousHandler):
    """A rendezvous handler on a shared directory that owns the workers' store.

    Build it with :func:`slurm_elastic.rendezvous.create_handler`.

    Args:
        run_id: the run id.
        min_nodes: minimum number of nodes of a round.
        max_nodes: maximum number of nodes of a round (more wait as spares).
        epoch: the epoch selected for this agent.
        incarnation: this agent's requeue identity.
        local_addr: the address other nodes use to reach this node.
        options: the parsed rendezvous options.
    """

    def __init__(
        self,
        *,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        epoch: Epoch,
        incarnation: Incarnation,
        local_addr: str,
        options: RendezvousOptions,
    ) -> None:
        node = DynamicRendezvousHandler._node_desc_generator.generate(local_addr)
        timeout = RendezvousTimeout(
            join=timedelta(seconds=options.join_timeout_s),
            last_call=timedelta(seconds=options.last_call_timeout_s),
            close=timedelta(seconds=options.close_timeout_s),
            heartbeat=timedelta(seconds=max(options.close_timeout_s, 1.0)),
        )
        settings = RendezvousSettings(
            run_id, min_nodes, max_nodes, timeout, keep_alive_interval=_NEVER,
            keep_alive_max_attempt=3,
        )  # fmt: skip
        backend = epoch.backend()
        holder = CounterStateHolder(
            backend,
            settings,
            cache_duration=min(0.5, options.heartbeat_interval_s),  # type: ignore[arg-type]
        )
        super().__init__(node, settings, BACKEND_NAME, dist.HashStore(), holder)
        self._holder = holder
        self._op_executor = self._executor = PollingOpExecutor(
            node,
            holder,
            settings,
            backend,
            options.poll_interval_s,
            min(options.reform_grace_s, options.last_call_timeout_s),
            IntentBoard(epoch.intents),
            # A pending node merges the intents itself once the claimant of the merge
            # could have been declared dead (it may have died after claiming).
            takeover_s=options.heartbeat_interval_s * options.heartbeat_miss_limit,
        )
        self._reform_grace = timedelta(
            seconds=min(options.reform_grace_s, options.last_call_timeout_s)
        )
        self._epoch = epoch
        self._incarnation = incarnation
        self._options = options
        self._local_addr = local_addr
        self._node_name = repr(node)
        self._monitor = HeartbeatMonitor(
            epoch.hb,
            self._node_name,
            interval_s=options.heartbeat_interval_s,
            miss_limit=options.heartbeat_miss_limit,
            successors=options.successors,
        )
        self._worker_store = WorkerStoreOwner(
            epoch, self._node_name, local_addr, options.store_port, options.store_timeout_s
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._round: int | None = None
        self._round_members: frozenset[_NodeDesc] | None = None
        self._seated_round: int | None = None  # the round join_round last completed
        self._keep_seat = False  # inside keeping_seat(): in place, the workers still train
        self._active = False
        atexit.register(_leave_at_exit, weakref.ref(self))

    def _record(self, message: str, node_state: Any = None, rank: int | None = None) -> None:
        log.debug("%s", message)

    # -- identity --------------------------------------------------------------------

    @property
    def node(self) -> str:
        """This node's descriptor as a string (``addr_pid_localid``)."""
        return self._node_name

    @property
    def epoch(self) -> Epoch:
        """The epoch this handler takes part in."""
        return self._epoch

    @property
    def options(self) -> RendezvousOptions:
        """The parsed rendezvous options."""
        return self._options

    @property
    def use_agent_store(self) -> bool:
        """See base class: workers are clients of the round's store, always."""
        return True

    # -- torch's keep-alive is replaced ------------------------------------------------

    def _start_heartbeats(self) -> None:
        pass

    def _stop_heartbeats(self) -> None:
        pass

    def _ensure_monitor(self) -> None:
        self._active = True
        if self._thread is not None and self._thread.is_alive():
            return
        self._monitor.reset()
        self._monitor.beat()  # our file exists before we appear in the state
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run_monitor,
            args=(self._stop,),
            name=f"slurm-rdzv-heartbeat-{self._node_name}",
            daemon=True,
        )
        self._thread.start()

    def _stop_monitor(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(2.0, 2 * self._options.heartbeat_interval_s))

    def _run_monitor(self, stop: threading.Event) -> None:
        holder = CounterStateHolder(self._epoch.backend(), self._settings, cache_duration=0)
        # Observe twice per beat interval: verdicts lag a stopped counter by at most
        # half an interval (the window itself is unchanged).
        tick = self._options.heartbeat_interval_s / 2
        ticks = 0
        while not stop.is_set():
            started = time.monotonic()
            if ticks % 2 == 0:
                self._monitor.beat()
            ticks += 1
            try:
                holder.sync()
                state = holder.state
                members = {
                    repr(n): n
                    for n in (*state.participants, *state.wait_list, *state.redundancy_list)
                }
                if self._node_name in members:
                    dead = self._monitor.observe(list(members))
                    if dead:
                        self._evict(holder, [members[name] for name in dead])
            except Exception as exc:  # the watcher must outlive transient FS errors
                log.warning("rendezvous heartbeat watcher: %s: %s", type(exc).__name__, exc)
            stop.wait(max(0.0, tick - (time.monotonic() - started)))

    def _evict(self, holder: CounterStateHolder, dead: list[_NodeDesc]) -> None:
        for _ in range(64):
            state: _RendezvousState = holder.state
            changed = removed_participant = False
            for node in dead:
                if node in state.participants:
                    del state.participants[node]
                    changed = removed_participant = True
                if node in state.wait_list:
                    state.wait_list.discard(node)
                    changed = True
                if node in state.redundancy_list:
                    state.redundancy_list.discard(node)
                    changed = True
                state.last_heartbeats.pop(node, None)
            board = IntentBoard(self._epoch.intents)
            for node in dead:  # a dead node's intent must not bring it back
                board.withdraw(IntentBoard.name(node))
            if not changed:
                self._forget_heartbeats(dead)
                return
            if removed_participant:
                _remove_participant_epilogue(state, self._settings)
            holder.mark_dirty()
            if holder.sync():
                names = ", ".join(repr(n) for n in dead)
                log.info(
                    "rendezvous %r: evicted %s (no heartbeat progress for %.1f s)",
                    self._settings.run_id,
                    names,
                    self._monitor.window_s,
                )
                events.emit(events.RendezvousEvicted(nodes=[repr(n) for n in dead]))
                self._forget_heartbeats(dead)
                return

    def _forget_heartbeats(self, dead: list[_NodeDesc]) -> None:
        """Remove the heartbeat files of evicted nodes (``hb/`` stays bounded).

        A node evicted while alive (a long stall) writes its file again on its next
        beat, and joins again.
        """
        for node in dead:
            try:
                self._epoch.hb.remove(node_file_name(repr(node)))
            except OSError as exc:
                log.debug("could not remove the heartbeat file of %r: %s", node, exc)

    # -- the rendezvous -------------------------------------------------------------------

    def _round_is_current(self, round_: int, rank0: _NodeDesc) -> bool:
        with self._heartbeat_lock:
            self._holder.invalidate()
            self._holder.sync()
            state = self._holder.state
        return (
            state.round == round_
            and state.complete
            and not state.closed
            and self._this_node in state.participants
            and rank0 in state.participants
        )

    def join_round(self, deadline: float) -> tuple[int, dict[_NodeDesc, int]]:
        """Run the join protocol only (exit the last round, join the next one).

        No heartbeat thread and no workers' store: :meth:`next_rendezvous` adds those.
        Used directly by ``bench/rendezvous.py`` to simulate many agents in threads.

        Returns:
            ``(round, {node: rank})`` of the completed round.
        """
        with self._heartbeat_lock:
            exit_op = ReseatExitOp(self._seated_round, reseat=self._keep_seat)
            self._op_executor.run(exit_op, deadline)
            self._op_executor.run(
                ReformJoinOp(self._reform_grace, self._executor.elapsed_at_decision),
                deadline,
                self._get_deadline,
            )
            state = self._holder.state
            self._seated_round = state.round
            return state.round, dict(state.participants)

    @contextmanager
    def keeping_seat(self) -> Iterator[None]:
        """Within: a re-join keeps this round's members seated (see ``SeatKeeping``).

        Only for a change in place, while this node's workers still train: a restart
        (workers stopped, e.g. because a member died) exits and joins as torch does, so a
        dead member is not carried into the next round (with ``max_nodes`` members seated
        that round would complete at once, with the dead one in it).
        """
        self._keep_seat = True
        try:
            yield
        finally:
            self._keep_seat = False

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round; return rank, world size and this round's stores.

        Raises:
            RendezvousClosedError: the run is closed.
            RendezvousTimeoutError: no round formed within ``join_timeout``.
        """
        started = time.monotonic()
        self._round_members = None
        self._ensure_monitor()
        deadline = self._get_deadline(self._settings.timeout.join)
        while True:
            round_, participants = self.join_round(deadline)
            if sorted(participants.values()) != list(range(len(participants))):
                # A member was evicted (or left) between the round's completion and
                # this node's read: the ranks have a hole. The round is broken for
                # everyone; join the next one instead of returning a bad rank.
                log.info("rendezvous %r: round %d lost a member; joining again",
                         self._settings.run_id, round_)  # fmt: skip
                continue
            rank, world = participants[self._this_node], len(participants)
            rank0 = next(n for n, r in participants.items() if r == 0)
            try:
                store, info = self._worker_store.setup(
                    round_,
                    rank,
                    repr(rank0),
                    functools.partial(self._round_is_current, round_, rank0),
                    deadline,
                    members=_members_digest(participants),
                )
            except RoundLostError as exc:
                log.info("rendezvous %r: %s; joining again", self._settings.run_id, exc)
                continue
            break
        self._round = round_
        self._round_members = frozenset(participants)
        log.info(
            "rendezvous %r complete: round %d, rank %d of %d, store %s:%d (%.2f s)",
            self._settings.run_id,
            round_,
            rank,
            world,
            info.master_addr,
            info.master_port,
            time.monotonic() - started,
        )
        events.emit(
            events.RendezvousComplete(
                round=round_,
                epoch=self._epoch.number,
                rank=rank,
                world_size=world,
                node=self._node_name,
                store=f"{info.master_addr}:{info.master_port}",
            )
        )
        return RendezvousInfo(store, rank, world, info)

    def num_nodes_waiting(self) -> int:
        """See base class; also > 0 when this node's round lost a member.

        Positive when nodes wait to join (unless the round is complete and full: no
        seat for them, they wait as spares), when a participant of this node's last round
        left or was evicted, when the round moved on, when this node was evicted, or
        when the run was closed: each means the workers must restart (a closed run
        then makes ``next_rendezvous`` raise, ending this agent promptly).
        """
        with self._heartbeat_lock:
            self._holder.sync()
            state = self._holder.state
            waiting = len(state.wait_list)
            if state.complete and len(state.participants) >= self._settings.max_nodes:
                # No seat for them: they move to the spares on their next poll (TO_SPARES)
                # and only a member's leaving (below) opens one.
                waiting = 0
            if self._lost(state):
                waiting = max(waiting, 1)
        return waiting

    def round_lost(self) -> bool:
        """Whether the round last joined lost a member, moved on, or the run closed.

        See :class:`~slurm_elastic.rendezvous.protocols.RoundWatching`.
        """
        with self._heartbeat_lock:
            self._holder.sync()
            return self._lost(self._holder.state)

    def _lost(self, state: _RendezvousState) -> bool:
        members = self._round_members
        return members is not None and (
            state.closed
            or state.round != self._round
            or not members.issubset(state.participants.keys())
        )

    @property
    def current_round(self) -> int | None:
        """The round the last ``next_rendezvous()`` returned (see ``RoundReporting``)."""
        return self._round

    def leave(self) -> None:
        """Remove this node from the rendezvous at once, without closing the run.

        Survivors see the round lose a member on their next ``num_nodes_waiting``
        poll and re-rendezvous without waiting for heartbeats to expire. Calling
        :meth:`next_rendezvous` later joins again.

        Raises:
            RendezvousTimeoutError: the removal could not be written in ``close_timeout``.
        """
        self._active = False
        self._stop_monitor()
        self._worker_store.close()
        with self._heartbeat_lock:
            self._holder.invalidate()
            self._op_executor.run(LeaveOp(), self._get_deadline(self._settings.timeout.close))
        self._monitor.remove()
        self._round_members = None
        self._seated_round = None
        log.info("rendezvous %r: node %s left", self._settings.run_id, self._node_name)
        events.emit(events.RendezvousLeft(node=self._node_name))

    def _leave_if_active(self) -> None:
        if not self._active:
            return
        try:
            self.leave()
        except Exception as exc:  # at interpreter exit: best effort only
            log.debug("leaving the rendezvous at exit failed: %s", exc)

    def shutdown(self) -> bool:
        """Close the run for every node (a finished or failed job); see base class."""
        self._active = False
        self._stop_monitor()
        self._worker_store.close()
        try:
            with self._heartbeat_lock:
                self._holder.invalidate()
                self._close()
            ok = True
        except RendezvousError as exc:
            log.warning(
                "rendezvous %r: could not close: %s: %s",
                self._settings.run_id,
                type(exc).__name__,
                exc,
            )
            ok = False
        self._monitor.remove()
        return ok
