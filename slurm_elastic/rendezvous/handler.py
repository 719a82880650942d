"""``SlurmRendezvousHandler``: torch's public ``RendezvousHandler`` on our own state.

The protocol is torch's dynamic rendezvous (min/max nodes, last call, join timeout,
waiting list, spares above ``max_nodes``, close), owned here: the state is our JSON
document (:mod:`.state`), the rules one pure module (:mod:`.decisions`), run by
:class:`~.executor.OpLoop` over the filesystem compare-and-set (:mod:`.backend`).
What it adds to torch's:

* **State** on the shared filesystem: no store host to lose; a node reads the header
  and its own row, not the whole state.
* **Heartbeats** are counters watched around a ring
  (:mod:`~slurm_elastic.rendezvous.heartbeat`) by a thread that runs for the handler's
  whole life (also while waiting as a spare). Dead nodes are evicted by a
  compare-and-set written by their watcher.
* **Links** (:mod:`~slurm_elastic.rendezvous.link`): once in a complete round, each
  member also holds a verified TCP connection to the participants it watches. A
  killed agent's kernel closes it at once, and its watcher evicts it then, without
  waiting out the heartbeat window (which still decides every silent loss).
* **Prompt restart**: :meth:`num_nodes_waiting` is also positive when a participant of
  this node's round is gone (left or evicted), when the round moved on, when this node
  itself was evicted, or when the run was closed, so torch's agent restarts at once.
* **Graceful leave**: :meth:`leave` removes this node without closing the run (called by
  our agent on preemption, and at interpreter exit if neither :meth:`shutdown` nor
  :meth:`leave` ran, e.g. torchrun exiting on SIGTERM).
* **Members seated first** (in place, inside :meth:`SlurmRendezvousHandler.keeping_seat`):
  a member re-joining from its completed round reopens it as the next round with all
  its participants seated (:data:`~.decisions.Act.RESEAT`), so newcomers get only the
  seats left and a node whose workers still train is never left out by them.
* **Workers' store**: owned per round by
  :class:`~slurm_elastic.rendezvous.worker_store.WorkerStoreOwner`.
* **Requeue safety**: the era is chosen by
  :meth:`~slurm_elastic.rendezvous.run_directory.RunDirectory.select_era`.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch.distributed.elastic.rendezvous.api import (
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
)

from slurm_elastic import events
from slurm_elastic.rendezvous import torch_compat  # noqa: F401  (refuses an old torch)
from slurm_elastic.rendezvous.backend import BACKEND_NAME, FileRendezvousBackend
from slurm_elastic.rendezvous.decisions import (
    Readable,
    Rules,
    decide_close,
    decide_exit,
    decide_join,
    decide_leave,
    evict,
    moved_on_in_place,
    round_broken,
)
from slurm_elastic.rendezvous.executor import OpLoop, Timing
from slurm_elastic.rendezvous.heartbeat import HeartbeatMonitor, WatchSchedule, node_file_name
from slurm_elastic.rendezvous.join_intents import IntentBoard
from slurm_elastic.rendezvous.member_links import MemberLinks
from slurm_elastic.rendezvous.options import RendezvousOptions
from slurm_elastic.rendezvous.resolver import check_reverse_lookup_once
from slurm_elastic.rendezvous.run_directory import Era, Incarnation
from slurm_elastic.rendezvous.state import PARTICIPANTS, WAITING, Node, encode_state, ring_after
from slurm_elastic.rendezvous.worker_store import RoundLostError, WorkerStoreOwner

__all__ = ["Seat", "SlurmRendezvousHandler", "new_node"]

log = logging.getLogger(__name__)

_LOCAL_IDS = itertools.count()
_LOCAL_IDS_LOCK = threading.Lock()


def new_node(addr: str) -> Node:
    """A node descriptor unique on this host: address, pid, per-process counter."""
    with _LOCAL_IDS_LOCK:
        local_id = next(_LOCAL_IDS)
    return Node(addr, os.getpid(), local_id)


@dataclass(frozen=True)
class Seat:
    """This node's place in a completed round.

    Attributes:
        round: the round number (the same on every node).
        rank: this node's rank; world: the round's size.
        rank0: the node of rank 0 (it hosts the round's store).
        formed: the generation that completed the round (with ``round``, it names the
            round's membership: nodes that agree on both agree on members and ranks).
    """

    round: int
    rank: int
    world: int
    rank0: Node
    formed: int


def _leave_at_exit(ref: weakref.ReferenceType[SlurmRendezvousHandler]) -> None:
    handler = ref()
    if handler is not None:
        handler._leave_if_active()


class SlurmRendezvousHandler(RendezvousHandler):
    """A rendezvous handler on a shared directory that owns the workers' store.

    Build it with :func:`slurm_elastic.rendezvous.create_handler`.

    Args:
        run_id: the run id.
        min_nodes: minimum number of nodes of a round.
        max_nodes: maximum number of nodes of a round (more wait as spares).
        era: the era selected for this agent.
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
        era: Era,
        incarnation: Incarnation,
        local_addr: str,
        options: RendezvousOptions,
    ) -> None:
        self._run_id = run_id
        self._node = new_node(local_addr)
        self._rules = Rules(min_nodes, max_nodes)
        self._timing = Timing(
            poll_s=options.poll_interval_s,
            last_call_s=options.last_call_timeout_s,
            grace_s=options.reform_grace_s,
            # A pending node merges the intents itself once the claimant of the merge
            # could have been declared dead (it may have died after claiming).
            takeover_s=options.heartbeat_interval_s * options.heartbeat_miss_limit,
        )
        self._loop = OpLoop(
            self._node, self._rules, era.backend(), self._timing, IntentBoard(era.intents),
            run_id,
        )  # fmt: skip
        self._lock = threading.Lock()
        self._era = era
        self._incarnation = incarnation
        self._options = options
        self._local_addr = local_addr
        check_reverse_lookup_once(local_addr)  # torch's store connections wait on it
        self._node_name = self._node.name
        self._monitor = HeartbeatMonitor(
            era.hb,
            self._node_name,
            interval_s=options.heartbeat_interval_s,
            miss_limit=options.heartbeat_miss_limit,
            successors=options.successors,
        )
        self._worker_store = WorkerStoreOwner(
            era, self._node_name, local_addr, options.store_port, options.store_timeout_s
        )
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._links = MemberLinks(
            self._node, self._monitor, lambda: self._wake.set(), run_id
        )  # fmt: skip
        self._round: int | None = None
        self._world: int | None = None  # the size of the round last returned
        self._seat: Seat | None = None
        self._seated_round: int | None = None  # the round join_round last completed
        self._seated_world = 0  # and its size
        self._keep_seat = False  # inside keeping_seat(): in place, the workers still train
        self._active = False
        atexit.register(_leave_at_exit, weakref.ref(self))

    # -- identity --------------------------------------------------------------------

    @property
    def node(self) -> str:
        """This node's descriptor as a string (``addr_pid_localid``)."""
        return self._node_name

    @property
    def era(self) -> Era:
        """The era this handler takes part in."""
        return self._era

    @property
    def options(self) -> RendezvousOptions:
        """The parsed rendezvous options."""
        return self._options

    def get_backend(self) -> str:
        """See base class: ``slurm``."""
        return BACKEND_NAME

    def get_run_id(self) -> str:
        """See base class."""
        return self._run_id

    @property
    def use_agent_store(self) -> bool:
        """See base class: workers are clients of the round's store, always."""
        return True

    def _deadline(self, seconds: float) -> float:
        return time.monotonic() + seconds

    # -- heartbeats -------------------------------------------------------------------

    def _ensure_monitor(self) -> None:
        self._active = True
        if self._thread is not None and self._thread.is_alive():
            return
        self._monitor.reset()
        self._monitor.beat()  # our file exists before we appear in the state
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(
            target=self._run_monitor,
            args=(self._stop, self._wake),
            name=f"slurm-rdzv-heartbeat-{self._node_name}",
            daemon=True,
        )
        self._thread.start()

    def _stop_monitor(self) -> None:
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(2.0, 2 * self._options.heartbeat_interval_s))

    def _run_monitor(self, stop: threading.Event, wake: threading.Event) -> None:
        backend = self._era.backend()  # its own descriptors: not shared across threads
        # Observe every half interval, every interval while calm: verdicts lag a stopped
        # counter by at most half an interval (the window itself is unchanged).
        schedule = WatchSchedule(self._options.heartbeat_interval_s)
        try:
            while True:
                wake.wait(schedule.wait_s())
                if stop.is_set():
                    return
                if wake.is_set():  # a link ended or went silent: judge it now / soon
                    wake.clear()
                    schedule.hurry()
                    self._evict_gone(backend)
                tick = schedule.tick()
                if tick is not None:
                    if tick.beat:
                        self._monitor.beat()
                    schedule.observed(self._observe(backend, tick.probe))
        finally:
            backend.close()

    def _observe(self, backend: FileRendezvousBackend, probe: bool) -> bool:
        """One observation of the watched members; return whether all was calm."""
        try:
            # ``head`` per tick, a probe past it every 4th (as the join's polls); the
            # view of an unchanged generation is kept with the rows it read.
            _, view = backend.view(probe=probe)
            if view.where(self._node) is None:
                self._links.watch(view, {})
                return True  # nothing to judge
            nodes: dict[str, Node] = {}
            dead = self._monitor.observe_ring(_named(ring_after(view, self._node), nodes))
            if dead:
                self._evict(backend, [nodes[name] for name in dead])
            self._links.watch(view, nodes)
            cut = self._links.unreachable(view)
            if cut:
                self._evict(backend, cut, cause="unreachable")
            return self._monitor.calm and not self._links.suspects
        except Exception as exc:  # the watcher must outlive transient FS errors
            log.warning("rendezvous heartbeat watcher: %s: %s", type(exc).__name__, exc)
            return False

    def _evict_gone(self, backend: FileRendezvousBackend) -> None:
        """Evict the watched members whose verified link ended (their process is gone)."""
        try:
            _, view = backend.view()
            dead = self._links.gone(view)
            if dead:
                self._evict(backend, dead, cause="link")
        except Exception as exc:  # the heartbeat window still decides
            log.warning("rendezvous link watcher: %s: %s", type(exc).__name__, exc)

    def verified_links(self) -> frozenset[str]:
        """The nodes this node holds a verified link to now (names)."""
        return self._links.verified()

    def _evict(
        self, backend: FileRendezvousBackend, dead: list[Node], cause: str = "heartbeat"
    ) -> None:
        board = IntentBoard(self._era.intents)
        for node in dead:  # a dead node's intent must not bring it back
            board.withdraw(IntentBoard.name(node))
        for _ in range(64):
            gen, state = backend.read_full()
            if state.where(self._node) is None:  # evicted meanwhile: no verdict of its stands
                return
            if not evict(state, dead, self._rules):
                self._forget_heartbeats(dead)
                return
            result = backend.set_state(encode_state(state), gen)
            if result is not None and result[2]:
                names = ", ".join(n.name for n in dead)
                why = {
                    "link": "its agent's link closed: the process is gone",
                    "unreachable": "it runs but its link went unanswered: cut off from us",
                }.get(cause, f"no heartbeat progress for {self._monitor.window_s:.1f} s")
                log.info("rendezvous %r: evicted %s (%s)", self._run_id, names, why)
                events.emit(events.RendezvousEvicted(nodes=[n.name for n in dead], cause=cause))
                self._forget_heartbeats(dead)
                return

    def _forget_heartbeats(self, dead: list[Node]) -> None:
        """Remove the heartbeat files of evicted nodes (``hb/`` stays bounded).

        A node evicted while alive (a long stall) writes its file again on its next
        beat, and joins again.
        """
        for node in dead:
            try:
                self._era.hb.remove(node_file_name(node.name))
            except OSError as exc:
                log.debug("could not remove the heartbeat file of %r: %s", node, exc)

    # -- the rendezvous -------------------------------------------------------------------

    def _round_is_current(self, round_: int, rank0: Node) -> bool:
        with self._lock:
            _, view = self._loop.backend.view()
            return (
                view.round == round_
                and view.complete
                and not view.closed
                and view.where(self._node) == PARTICIPANTS
                and view.where(rank0) == PARTICIPANTS
            )

    def join_round(self, deadline: float) -> Seat | None:
        """Run the join protocol only (exit the last round, join the next one).

        No heartbeat thread and no workers' store: :meth:`next_rendezvous` adds those.
        Used directly by ``bench/rendezvous.py`` to simulate many agents in threads.

        Returns:
            This node's seat in the completed round, or None when the round lost a
            member before this node read it (join again).
        """
        node, rules = self._node, self._rules
        evicted = False
        if self._seated_round is not None:
            with self._lock:
                _, now = self._loop.backend.view()
                evicted = now.where(node) is None
        if evicted:  # while it ran: first make sure it is not cut off from the members
            members = [n for n in ring_after(now, node) if now.where(n) == PARTICIPANTS]
            self._links.wait_reachable(members, deadline)
        with self._lock:
            seated, reseat = self._seated_round, self._keep_seat
            exited = self._loop.run(
                lambda v, c: decide_exit(v, node, c, seated_round=seated, reseat=reseat),
                deadline,
            )
            # In place after a loss, every member of the last round is seated by the first
            # one back (RESEAT) and nobody is arriving: the round completes without the
            # re-formation grace (which gathers arrivals into one round) once nobody waits.
            after_loss = reseat and exited.count(PARTICIPANTS) < self._seated_world
            view = self._loop.run(
                lambda v, c: decide_join(
                    v, node, rules, dataclasses.replace(c, grace_passed=True) if after_loss else c
                ),
                deadline,
                renew=lambda: self._deadline(self._options.join_timeout_s),
            )
            self._seated_round = view.round
            self._seated_world = view.count(PARTICIPANTS)
            return _seat(view, node)

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
        self._round = self._world = self._seat = None
        self._ensure_monitor()
        deadline = self._deadline(self._options.join_timeout_s)
        while True:
            seat = self.join_round(deadline)
            if seat is None:
                # A member was evicted (or left) between the round's completion and
                # this node's read. The round is broken for everyone: join the next one.
                log.info("rendezvous %r: the round lost a member; joining again", self._run_id)
                continue
            try:
                store, info = self._worker_store.setup(
                    seat.round,
                    seat.rank,
                    seat.rank0.name,
                    functools.partial(self._round_is_current, seat.round, seat.rank0),
                    deadline,
                    members=f"{seat.round}.{seat.formed}",
                )
            except RoundLostError as exc:
                log.info("rendezvous %r: %s; joining again", self._run_id, exc)
                continue
            break
        self._round, self._world, self._seat = seat.round, seat.world, seat
        log.info(
            "rendezvous %r complete: round %d, rank %d of %d, store %s:%d (%.2f s)",
            self._run_id,
            seat.round,
            seat.rank,
            seat.world,
            info.master_addr,
            info.master_port,
            time.monotonic() - started,
        )
        events.emit(
            events.RendezvousComplete(
                round=seat.round,
                era=self._era.number,
                rank=seat.rank,
                world_size=seat.world,
                node=self._node_name,
                store=f"{info.master_addr}:{info.master_port}",
            )
        )
        return RendezvousInfo(store, seat.rank, seat.world, info)

    def num_nodes_waiting(self) -> int:
        """See base class; also > 0 when this node's round lost a member.

        Positive when nodes wait to join (unless the round is complete and full: no
        seat for them, they wait as spares), when a participant of this node's last round
        left or was evicted, when the round moved on, when this node was evicted, or
        when the run was closed: each means the workers must restart (a closed run
        then makes ``next_rendezvous`` raise, ending this agent promptly).
        """
        with self._lock:
            _, view = self._loop.backend.view()
            waiting = view.count(WAITING)
            if view.complete and view.count(PARTICIPANTS) >= self._rules.max_nodes:
                # No seat for them: they move to the spares on their next poll and only
                # a member's leaving (below) opens one.
                waiting = 0
            if self._lost(view):
                waiting = max(waiting, 1)
        return waiting

    def round_lost(self) -> bool:
        """Whether the round last joined lost a member, moved on, or the run closed.

        See :class:`~slurm_elastic.rendezvous.protocols.RoundWatching`.
        """
        with self._lock:
            _, view = self._loop.backend.view()
            return self._lost(view)

    def round_moved_on_in_place(self) -> bool:
        """See :class:`~slurm_elastic.rendezvous.protocols.RoundWatching`."""
        with self._lock:
            _, view = self._loop.backend.view()
            return moved_on_in_place(view, self._node, self._round, self._world)

    def _lost(self, view: Readable) -> bool:
        return round_broken(view, self._round, self._world)

    @property
    def seat(self) -> Seat | None:
        """This node's seat in the round the last ``next_rendezvous()`` returned."""
        return self._seat

    @property
    def current_round(self) -> int | None:
        """The round the last ``next_rendezvous()`` returned (see ``RoundReporting``)."""
        return self._round

    def is_closed(self) -> bool:
        """See base class: whether the run is closed."""
        with self._lock:
            _, view = self._loop.backend.view()
            return view.closed

    def set_closed(self) -> None:
        """See base class: close the run for every node."""
        with self._lock:
            self._loop.run(
                lambda v, c: decide_close(v, c), self._deadline(self._options.close_timeout_s)
            )

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
        node = self._node
        with self._lock:
            self._loop.run(
                lambda v, c: decide_leave(v, node, c),
                self._deadline(self._options.close_timeout_s),
            )
        self._monitor.remove()
        self._links.close()  # after leaving: its end is then no evidence against this node
        self._round = self._world = self._seat = None
        self._seated_round = None
        self._seated_world = 0
        log.info("rendezvous %r: node %s left", self._run_id, self._node_name)
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
            self.set_closed()
            ok = True
        except RendezvousError as exc:
            log.warning(
                "rendezvous %r: could not close: %s: %s", self._run_id, type(exc).__name__, exc
            )
            ok = False
        self._monitor.remove()
        self._links.close()
        return ok


def _named(nodes: Iterator[Node], seen: dict[str, Node]) -> Iterator[str]:
    """The names of ``nodes``, recording each in ``seen`` (lazily)."""
    for node in nodes:
        seen[node.name] = node
        yield node.name


def _seat(view: Readable, node: Node) -> Seat | None:
    """This node's seat in the complete round ``view``, or None when the round broke."""
    if view.world is None or view.formed is None or view.count(PARTICIPANTS) != view.world:
        return None
    rank = view.index(node, PARTICIPANTS)
    if rank is None:
        return None
    return Seat(view.round, rank, view.world, view.node_at(PARTICIPANTS, 0), view.formed)
