"""The rendezvous operation loop: torch's op executor, polling, join intents, last call.

Split from :mod:`.handler`, which builds these per agent:

* :class:`CounterStateHolder`: torch's state holder without its wall-clock sweep;
* :class:`PollingOpExecutor`: torch's op loop with change-driven polling,
  compare-and-set backoff, join intents (:mod:`.join_intents`) and the last call timed
  on this node's monotonic clock;
* :class:`ReformJoinOp`: torch's join plus prompt re-formation;
* :class:`ReseatExitOp`: a member leaves its completed round by reopening it with
  the round's members kept seated (instead of torch's exit-then-join);
* :class:`LeaveOp`: leave without closing the run.
"""

from __future__ import annotations

import copy
import logging
import pickle
import random
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousTimeoutError,
)

from slurm_elastic.rendezvous.backend import FileRendezvousBackend, load_state
from slurm_elastic.rendezvous.join_intents import (
    JOIN_ACTIONS,
    IntentBoard,
    member_names,
    merge_intents,
)
from slurm_elastic.rendezvous.torch_compat import (
    RendezvousSettings,
    _Action,
    _BackendRendezvousStateHolder,
    _DistributedRendezvousOpExecutor,
    _NodeDesc,
    _RendezvousContext,
    _RendezvousExitOp,
    _RendezvousJoinOp,
    _RendezvousState,
)

__all__ = [
    "RESEAT",
    "TO_SPARES",
    "CounterStateHolder",
    "LeaveOp",
    "PollingOpExecutor",
    "ReformJoinOp",
    "ReseatExitOp",
]

log = logging.getLogger(__name__)

_POLL_CAP_S = 0.25
_SLOT_S = 0.005
_PER_INTENT_S = 0.0005
_MAX_BATCH_ESTIMATE = 2048
# What torch's join op sees as the last-call deadline once this node's own monotonic
# measurement says it passed (or not): torch compares it with its wall clock.
_PAST = datetime.min.replace(tzinfo=timezone.utc)
_FUTURE = datetime.max.replace(tzinfo=timezone.utc)


class _OwnAction:
    """A state change of our own (torch's ``_Action`` enum cannot be extended)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


#: Reopen this node's completed round as the next one, its members kept seated.
RESEAT = _OwnAction("RESEAT")
#: Move this node from the wait list to the redundancy list (the round is full).
TO_SPARES = _OwnAction("TO_SPARES")


class CounterStateHolder(_BackendRendezvousStateHolder):
    """Torch's state holder without its wall-clock dead-node sweep.

    :meth:`sync` is torch's, except how a state read is decoded: with
    :func:`~slurm_elastic.rendezvous.backend.load_state` (the restricted, checked
    decoder, run once per distinct state per process, then a cheap copy) instead of a
    plain ``pickle.loads`` per read, and a state this holder just wrote is kept as is
    instead of being decoded again. At 1,024 nodes a state is ~60 KB and unpickling it
    costs ~10 ms of CPU: torch's way made every agent pay that on every change.
    """

    def sync(self) -> bool | None:
        """See base class (same contract: True/False after a write, None after a read)."""
        state_bits: bytes | None = None
        token = None
        has_set: bool | None
        if self._dirty:
            has_set = False
            state_bits = pickle.dumps(self._state)
            response = self._backend.set_state(state_bits, self._token)
            if response is not None:
                state_bits, token, has_set = response
        else:
            has_set = None
            if self._cache_duration > 0 and self._last_sync_time >= max(
                time.monotonic() - self._cache_duration, 0
            ):
                return None
            got = self._backend.get_state()
            if got is not None:
                state_bits, token = got
        if state_bits is None:
            self._state = _RendezvousState()
        elif not has_set:  # a won write keeps the very state it wrote
            self._state = load_state(state_bits)
        self._token = token
        self._dirty = False
        self._last_sync_time = time.monotonic()
        self._sanitize()
        return has_set

    def _sanitize(self) -> None:
        self._dead_nodes = []

    def invalidate(self) -> None:
        """Make the next :meth:`sync` read the backend."""
        self._last_sync_time = -1

    @property
    def token(self) -> Any:
        """The generation of the state last read or written."""
        return self._token


class PollingOpExecutor(_DistributedRendezvousOpExecutor):
    """Torch's op loop with change-driven polling and compare-and-set backoff."""

    def __init__(
        self,
        node: _NodeDesc,
        holder: CounterStateHolder,
        settings: RendezvousSettings,
        backend: FileRendezvousBackend,
        poll_s: float,
        reform_grace_s: float,
        board: IntentBoard | None = None,
        takeover_s: float = 5.0,
    ) -> None:
        super().__init__(node, holder, settings)
        self._holder = holder
        self._board = board
        self._takeover_s = takeover_s
        self._posted_at: float | None = None
        self._backend = backend
        self._poll_s = poll_s
        self._reform_grace_s = reform_grace_s
        self._last_call: tuple[Any, float] | None = None
        self._elapsed_at_decision: float | None = None

    def elapsed_at_decision(self) -> float | None:
        """:meth:`last_call_elapsed` of the state of the decision being made."""
        return self._elapsed_at_decision

    def run(
        self,
        state_handler: Callable[[_RendezvousContext, float], _Action],
        deadline: float,
        update_deadline: Callable[[timedelta], float] | None = None,
    ) -> None:
        """See base class."""
        action = None
        losses = 0
        while action != _Action.FINISH:
            has_set = self._holder.sync()
            if has_set is False:
                # Binary exponential backoff: many nodes joining at once otherwise keep
                # colliding (each loss costs a re-read and another write attempt).
                losses += 1
                time.sleep(random.uniform(0, _SLOT_S * (2 ** min(losses, 6))))
                # Others wrote while we slept: decide on a fresh state, or the next
                # compare-and-set is lost for certain.
                self._holder.invalidate()
                self._holder.sync()
            self._state = self._holder.state
            ctx = _RendezvousContext(self._node, self._decision_view(self._state), self._settings)
            action = state_handler(ctx, deadline)
            if self._board is not None:
                if action in JOIN_ACTIONS:
                    self._join_by_intent(deadline)
                    continue
                self.withdraw_intent()
            if action == _Action.FINISH:
                continue
            if action is RESEAT or action is TO_SPARES:
                self._reseat() if action is RESEAT else self._to_spares()
                self._holder.mark_dirty()
                continue
            if action == _Action.ERROR_CLOSED:
                raise RendezvousClosedError(
                    f"the rendezvous of run {self._settings.run_id!r} is closed (the run "
                    "finished or failed); requeue the job or use a new run id to start again"
                )
            if action == _Action.ERROR_TIMEOUT:
                raise RendezvousTimeoutError(
                    f"rendezvous of run {self._settings.run_id!r} timed out with "
                    f"{len(self._state.participants)} of min {self._settings.min_nodes} nodes; "
                    "raise join_timeout or check why the other nodes did not start"
                )
            if action == _Action.SYNC:
                self._wait_for_change(deadline)
                continue
            if action in (
                _Action.REMOVE_FROM_PARTICIPANTS,
                _Action.REMOVE_FROM_WAIT_LIST,
                _Action.REMOVE_FROM_REDUNDANCY_LIST,
            ):
                # An eviction by a watcher may have dropped our entry; torch's removal
                # code indexes it unconditionally.
                self._state.last_heartbeats.setdefault(self._node, datetime.now(timezone.utc))
            self._apply(action)
            if action == _Action.REMOVE_FROM_REDUNDANCY_LIST and update_deadline:
                deadline = update_deadline(self._settings.timeout.join)
            self._holder.mark_dirty()

    def withdraw_intent(self) -> None:
        """Remove this node's join intent if it posted one."""
        if self._posted_at is not None and self._board is not None:
            self._posted_at = None
            self._board.withdraw(IntentBoard.name(self._node))

    def _join_by_intent(self, deadline: float) -> None:
        """Post this node's intent; merge all pending ones if this node wins the claim.

        Per pending node: one ``open`` (the intent), one ``mkdir`` (the claim of the
        merge at the current generation; all but one lose), then change-driven polls of
        ``head`` until a merge adds it. Only the claim's winner lists the intents (and
        reads them): no O(N) listing per node.
        """
        board = self._board
        if board is None:  # an internal invariant: only called once the board exists
            raise RuntimeError("join by intent without an intent board")
        me = IntentBoard.name(self._node)
        if self._posted_at is None:
            board.post(self._node)
            self._posted_at = time.monotonic()
            time.sleep(self._poll_s)  # let simultaneous arrivals post: one merge for all
        # Decide on a fresh state: with a cached one, nodes merged a moment ago still
        # look pending.
        self._holder.invalidate()
        self._holder.sync()
        self._state = self._holder.state
        if me in member_names(self._state):
            return
        generation = int(self._holder.token or 0)
        takeover_at = self._posted_at + self._takeover_s
        if time.monotonic() < takeover_at:
            if not board.claim(generation):
                # Another node merges the batch pending at this generation. No
                # periodic wake-up: only a state change (a merge) or the takeover
                # time matters, so N waiters cost nothing per second between merges.
                # A batch of m intents takes the winner about m x 0.5 ms to read and
                # apply; m is at most the room left in the round: first look after
                # that (polls per node stay flat as batches grow).
                room = max(0, self._settings.max_nodes - len(self._state.participants))
                self._wait_for_change(
                    deadline,
                    first=self._poll_s + min(room, _MAX_BATCH_ESTIMATE) * _PER_INTENT_S,
                    horizon=max(1.0, takeover_at - time.monotonic()),
                )
                return
        else:
            # Takeover (the claim's winner died): staggered by position, so one node
            # goes first (rare: one listing per pending node).
            pending = board.pending(member_names(self._state))
            position = pending.index(me) if me in pending else len(pending)
            if time.monotonic() < takeover_at + 0.02 * position:
                self._wait_for_change(
                    deadline, horizon=takeover_at + 0.02 * position - time.monotonic()
                )
                return
        board.release_claims(below=generation)
        pending = board.pending(member_names(self._state))
        # Gather: merge once the batch stops growing for a poll interval, or holds
        # every node the round can still take (one write for a simultaneous start).
        room = self._settings.max_nodes - len(self._state.participants)
        while len(pending) < room and time.monotonic() < deadline:
            time.sleep(self._poll_s)
            grown = board.pending(member_names(self._state))
            if len(grown) <= len(pending):
                break
            pending = grown
        self._holder.invalidate()
        self._holder.sync()
        state = self._holder.state
        if merge_intents(state, self._settings, board, board.pending(member_names(state))):
            self._holder.mark_dirty()
            if self._holder.sync() is False:
                time.sleep(random.uniform(0, _SLOT_S * 4))
                self._holder.invalidate()

    def _reseat(self) -> None:
        """Open the next round with this completed round's participants seated.

        One compare-and-set: between a member's exit and its join (torch's way) the
        newcomers on the wait list could take every seat of the next round while this
        member's workers still train in the old one.
        """
        state = self._state
        state.round += 1
        state.complete = False
        for node in state.participants:
            state.participants[node] = 0
        state.deadline = None
        self._keep_alive()
        if len(state.participants) >= self._settings.min_nodes:
            state.deadline = datetime.now(timezone.utc) + self._settings.timeout.last_call
        if len(state.participants) >= self._settings.max_nodes:
            self._mark_rendezvous_complete()

    def _to_spares(self) -> None:
        """Wait as a spare: the round is complete and full (else members re-form forever)."""
        self._state.wait_list.discard(self._node)
        self._state.redundancy_list.add(self._node)
        self._keep_alive()

    def _record(self, message: str, node_state: Any = None) -> None:
        # Torch's version builds an event with inspect.stack() (milliseconds of CPU per
        # call, and per state change); our own events cover the lifecycle.
        log.debug("%s", message)

    def _apply(self, action: _Action) -> None:
        handlers: dict[_Action, Callable[[], None]] = {
            _Action.KEEP_ALIVE: self._keep_alive,
            _Action.ADD_TO_PARTICIPANTS: self._add_to_participants,
            _Action.ADD_TO_WAIT_LIST: self._add_to_wait_list,
            _Action.ADD_TO_REDUNDANCY_LIST: self._add_to_redundancy_list,
            _Action.REMOVE_FROM_PARTICIPANTS: self._remove_from_participants,
            _Action.REMOVE_FROM_WAIT_LIST: self._remove_from_wait_list,
            _Action.REMOVE_FROM_REDUNDANCY_LIST: self._remove_from_redundancy_list,
            _Action.MARK_RENDEZVOUS_COMPLETE: self._mark_rendezvous_complete,
            _Action.MARK_RENDEZVOUS_CLOSED: self._mark_rendezvous_closed,
        }
        handlers[action]()

    def last_call_elapsed(self, state: _RendezvousState) -> float | None:
        """Seconds since this node first saw the current last call (monotonic).

        Torch writes the last-call deadline as the *writer's* wall-clock time and
        compares it with the reader's. Here the deadline value only identifies a last
        call: each node times it from its own first observation, on its own monotonic
        clock, so neither clock skew between nodes nor a clock step matters (a node
        that observes it later waits at most one poll interval longer).
        """
        if state.deadline is None or state.complete:
            return None
        key = (state.round, state.deadline)
        if self._last_call is None or self._last_call[0] != key:
            self._last_call = (key, time.monotonic())
        return time.monotonic() - self._last_call[1]

    def _decision_view(self, state: _RendezvousState) -> _RendezvousState:
        """``state`` with its deadline replaced by this node's monotonic verdict."""
        elapsed = self._elapsed_at_decision = self.last_call_elapsed(state)
        if elapsed is None:
            return state
        view = copy.copy(state)  # shallow: torch's ops only read the context's state
        due = elapsed >= self._settings.timeout.last_call.total_seconds()
        view.deadline = _PAST if due else _FUTURE
        return view

    def _wait_for_change(
        self, deadline: float, first: float | None = None, horizon: float = 1.0
    ) -> None:
        """Sleep until the state changes, 1 s passes, or a last-call deadline is due.

        ``first``: the first poll delay (default ``poll_interval``), doubling up to
        0.25 s (or ``first``, if larger) after that; ``horizon``: the longest sleep
        without a change (default 1 s).
        """
        now = time.monotonic()
        wake = min(now + horizon, deadline)
        elapsed = self.last_call_elapsed(self._state)
        if elapsed is not None:
            due = self._settings.timeout.last_call.total_seconds() - elapsed
            early = self._reform_grace_s - elapsed
            for at in (due, early):
                if at > 0:
                    wake = min(wake, now + at + 0.005)
        seen = self._holder.token or 0  # no state yet: token None, generation 0
        delay = first or self._poll_s
        cap = max(_POLL_CAP_S, delay)
        polls = 0
        while True:
            now = time.monotonic()
            if now >= wake:
                break
            time.sleep(min(delay, wake - now))
            delay = min(delay * 2, cap)
            polls += 1
            # One open of ``head`` per poll; every 4th poll also probes past it.
            if self._backend.latest_generation(probe=polls % 4 == 0) != seen:
                break
        self._holder.invalidate()


class ReformJoinOp(_RendezvousJoinOp):
    """Torch's join, plus: a re-formation completes once nobody else is expected.

    In a round after the first, the members of the previous round are already seated
    (:class:`ReseatExitOp`) or have left, and the nodes that will join are on the wait
    list. Once the wait list is empty, ``min_nodes`` have joined and a short grace
    (for nodes between two state writes) has passed, waiting the rest of the last
    call only delays recovery: the round completes. A node that turns up later is a
    late joiner as usual (it waits and the members restart). A node on the wait list
    of a complete round that is full moves to the redundancy list (:data:`TO_SPARES`):
    with the members seated first, a re-formation could not seat it, and waiting on
    the list would make the members re-form over and over.
    """

    def __init__(self, grace: timedelta, elapsed: Callable[[], float | None]) -> None:
        self._grace = grace.total_seconds()
        self._elapsed = elapsed

    def __call__(self, ctx: _RendezvousContext, deadline: float) -> Any:
        state = ctx.state
        if (
            not state.closed
            and state.complete
            and ctx.node in state.wait_list
            and len(state.participants) >= ctx.settings.max_nodes
            and time.monotonic() <= deadline
        ):
            return TO_SPARES
        if (
            not state.closed
            and not state.complete
            and state.round > 0
            and state.deadline is not None
            and not state.wait_list
            and ctx.node in state.participants
            and len(state.participants) >= ctx.settings.min_nodes
            and (self._elapsed() or 0.0) >= self._grace
        ):
            return _Action.MARK_RENDEZVOUS_COMPLETE
        return super().__call__(ctx, deadline)


class ReseatExitOp:
    """Leave the round this node last completed, keeping its members seated.

    Torch's exit removes the node from the participants; the last one out opens the
    next round, which every node then joins anew: newcomers on the wait list can fill
    ``max_nodes`` before a member that was training rejoins, and that member's workers
    train on in the old round while the newcomers start a second training. Here:

    * ``reseat`` and this node is a participant of ``seated_round``, still the current,
      complete round: reopen it as the next round with all its participants seated
      (:data:`RESEAT`, one compare-and-set); newcomers get the remaining seats;
    * this node is a participant of a later round: another member reopened it with
      this node seated: nothing to leave. This holds for a restart too (``reseat``
      false): leaving that round once it completed would leave its members waiting for
      this node's rank in the round's store;
    * otherwise (first round of this handler, a closed run, a restart from the current
      round): torch's exit.

    Args:
        seated_round: the round this node last completed, or None.
        reseat: whether this node keeps its round's members seated (an in-place
            re-join) or leaves the current round as torch does (a restart).
    """

    def __init__(self, seated_round: int | None, *, reseat: bool = True) -> None:
        self._seated = seated_round
        self._reseat = reseat
        self._torch_exit = _RendezvousExitOp()

    def __call__(self, ctx: _RendezvousContext, deadline: float) -> Any:
        state = ctx.state
        if self._seated is None or state.closed or ctx.node not in state.participants:
            return self._torch_exit(ctx, deadline)
        if state.round > self._seated:
            return _Action.FINISH  # seated in a later round by another member
        if not self._reseat:
            return self._torch_exit(ctx, deadline)
        if time.monotonic() > deadline:
            return _Action.ERROR_TIMEOUT
        if state.round == self._seated and state.complete:
            return RESEAT
        return self._torch_exit(ctx, deadline)


class LeaveOp:
    """Remove this node from participants, wait list and redundancy list."""

    def __call__(self, ctx: _RendezvousContext, deadline: float) -> _Action:
        if ctx.node in ctx.state.participants:
            if time.monotonic() > deadline:
                return _Action.ERROR_TIMEOUT
            return _Action.REMOVE_FROM_PARTICIPANTS
        if ctx.node in ctx.state.wait_list:
            return _Action.REMOVE_FROM_WAIT_LIST
        if ctx.node in ctx.state.redundancy_list:
            return _Action.REMOVE_FROM_REDUNDANCY_LIST
        return _Action.FINISH
