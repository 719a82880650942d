"""The rendezvous operation loop: read, decide, write, wait for a change.

:class:`OpLoop` runs one operation (join, exit, leave, close: a ``decide`` function of
:mod:`.decisions`) until it finishes:

1. read a :class:`~.state.StateView` of the newest generation (the header and this
   node's row: ``O(log N)`` bytes) and decide on it, with this node's own monotonic
   clock (:class:`~.decisions.Clock`: the operation's deadline, the last call);
2. to *add* a node, post a join intent and let one node merge the batch
   (:mod:`.join_intents`); to change anything else, read the whole state of that same
   generation, decide again on it (the same answer, or the state moved on), apply the
   change (:func:`~.decisions.apply`) and write it with one compare-and-set; a loser
   backs off a random few milliseconds, doubling;
3. to wait, poll the cheap ``head`` pointer with a backoff from ``poll_interval`` to
   0.25 s until the generation changes, a last-call timer is due, or 1 s passed.

The last call is timed on this node's monotonic clock from its own first observation
of it (:class:`LastCallTimer`): clock skew between nodes and clock steps do not matter.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)

from slurm_elastic.rendezvous.backend import FileRendezvousBackend
from slurm_elastic.rendezvous.decisions import (
    JOIN_ACTS,
    Act,
    Clock,
    Readable,
    Rules,
    apply,
    merge,
)
from slurm_elastic.rendezvous.join_intents import IntentBoard
from slurm_elastic.rendezvous.state import PARTICIPANTS, SPARES, Node, State, encode_state

__all__ = ["LastCallTimer", "OpLoop", "Timing"]

log = logging.getLogger(__name__)

_POLL_CAP_S = 0.25
_SLOT_S = 0.005
_PER_INTENT_S = 0.0005
_MAX_BATCH_ESTIMATE = 2048

Decide = Callable[[Readable, Clock], Act]


class LastCallTimer:
    """How long this node has seen the current last call (monotonic, its own clock).

    Args:
        clock: a monotonic clock (injectable for tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seen: tuple[tuple[int, int], float] | None = None

    def elapsed(self, state: Readable) -> float | None:
        """Seconds since this node first saw ``state``'s last call; None without one."""
        if state.last_call is None or state.complete:
            return None
        key = (state.round, state.last_call)
        now = self._clock()
        if self._seen is None or self._seen[0] != key:
            self._seen = (key, now)
        return now - self._seen[1]


class Timing:
    """The loop's timing settings (seconds).

    Args:
        poll_s: the first poll delay while waiting.
        last_call_s: how long a last call lasts.
        grace_s: the re-formation grace (a round after the first completes once nobody
            waits and this passed).
        takeover_s: after this, another node takes over a step whose designated node
            did not act (the merge of join intents, completing a round).
    """

    def __init__(self, poll_s: float, last_call_s: float, grace_s: float, takeover_s: float):
        self.poll_s = poll_s
        self.last_call_s = last_call_s
        self.grace_s = min(grace_s, last_call_s)
        self.takeover_s = takeover_s
        # A participant other than the first completes a round this long after it is
        # due (the first one is gone or slow): one writer in the normal case.
        self.overdue_s = last_call_s + max(1.0, min(takeover_s, 2 * last_call_s))


class OpLoop:
    """Runs rendezvous operations for one node (see the module docstring)."""

    def __init__(
        self,
        node: Node,
        rules: Rules,
        backend: FileRendezvousBackend,
        timing: Timing,
        board: IntentBoard | None,
        run_id: str,
    ) -> None:
        self._node = node
        self._rules = rules
        self._backend = backend
        self._timing = timing
        self._board = board
        self._run_id = run_id
        self._timer = LastCallTimer()
        self._posted_at: float | None = None

    @property
    def backend(self) -> FileRendezvousBackend:
        """The state backend."""
        return self._backend

    def clock(self, state: Readable, deadline: float) -> Clock:
        """What this node's clock says now about ``state`` and ``deadline``."""
        elapsed = self._timer.elapsed(state)
        t = self._timing
        return Clock(
            timed_out=time.monotonic() > deadline,
            last_call_due=elapsed is not None and elapsed >= t.last_call_s,
            grace_passed=elapsed is not None and elapsed >= t.grace_s,
            overdue=elapsed is not None and elapsed >= t.overdue_s,
        )

    def run(
        self, decide: Decide, deadline: float, renew: Callable[[], float] | None = None
    ) -> Readable:
        """Run one operation until it finishes; return the state it finished on.

        Args:
            decide: the operation's rule (state, clock) -> act.
            deadline: the monotonic deadline of the operation.
            renew: called when this node leaves the spares for a seat: the new deadline.

        Raises:
            RendezvousClosedError: the run is closed.
            RendezvousGracefulExitError: the run closed while this node was a spare.
            RendezvousTimeoutError: the operation did not finish by its deadline.
        """
        losses = 0
        told_spare = False
        while True:
            gen, view = self._backend.view()
            act = decide(view, self.clock(view, deadline))
            if act in JOIN_ACTS and self._board is not None:
                self._join_by_intent(deadline)
                continue
            self.withdraw_intent()
            if act is Act.FINISH:
                return view
            if act is Act.SYNC:
                if not told_spare and view.where(self._node) == SPARES:
                    told_spare = True
                    log.info(
                        "rendezvous %r: the round is full (%d of max %d nodes): waiting as "
                        "a spare until a member leaves",
                        self._run_id,
                        view.count(PARTICIPANTS),
                        self._rules.max_nodes,
                    )
                self._wait_for_change(view, gen, deadline)
                continue
            if act is Act.ERROR_CLOSED:
                if view.where(self._node) == SPARES:
                    raise RendezvousGracefulExitError(
                        f"the rendezvous of run {self._run_id!r} is closed; this spare "
                        "is no longer needed"
                    )
                raise RendezvousClosedError(
                    f"the rendezvous of run {self._run_id!r} is closed (the run finished "
                    "or failed); requeue the job or use a new run id to start again"
                )
            if act is Act.ERROR_TIMEOUT:
                raise RendezvousTimeoutError(
                    f"rendezvous of run {self._run_id!r} timed out with "
                    f"{view.count(PARTICIPANTS)} of min {self._rules.min_nodes} nodes; "
                    "raise join_timeout or check why the other nodes did not start"
                )
            # A change: decide again on the whole state of the same generation.
            full_gen, state = self._backend.read_full()
            if full_gen != gen or decide(state, self.clock(state, deadline)) is not act:
                continue
            apply(state, self._node, act, self._rules, generation=gen + 1)
            if self.write(state, gen):
                losses = 0
                if act is Act.LEAVE_SPARES and renew is not None:
                    deadline = renew()
            else:
                # Binary exponential backoff: nodes writing at once otherwise collide.
                losses += 1
                time.sleep(random.uniform(0, _SLOT_S * (2 ** min(losses, 6))))

    def write(self, state: State, generation: int) -> bool:
        """Publish ``state`` as generation ``generation + 1`` (compare-and-set)."""
        result = self._backend.set_state(encode_state(state), generation)
        return result is not None and result[2]

    def withdraw_intent(self) -> None:
        """Remove this node's join intent if it posted one."""
        if self._posted_at is not None and self._board is not None:
            self._posted_at = None
            self._board.withdraw(IntentBoard.name(self._node))

    def _merged(self, view: Readable) -> bool:
        where = view.where(self._node)
        return where == PARTICIPANTS or (view.complete and where is not None)

    def _join_by_intent(self, deadline: float) -> None:
        """Post this node's intent; merge all pending ones if this node wins the claim.

        Per pending node: one ``open`` (the intent), one ``mkdir`` (the claim of the
        merge at the current generation; all but one lose), then change-driven polls of
        ``head`` until a merge adds it. Only the claim's winner lists the intents (and
        reads them): no O(N) listing per node.
        """
        board = self._board
        if board is None:
            raise RuntimeError("join by intent without an intent board")
        if self._posted_at is None:
            board.post(self._node)
            self._posted_at = time.monotonic()
            time.sleep(self._timing.poll_s)  # let simultaneous arrivals post: one merge
        gen, view = self._backend.view()
        if self._merged(view):
            return
        takeover_at = self._posted_at + self._timing.takeover_s
        if time.monotonic() < takeover_at:
            if not board.claim(gen):
                # Another node merges the batch pending at this generation. No periodic
                # wake-up: only a merge or the takeover time matters. A batch of m
                # intents takes the winner about m x 0.5 ms: first look after that.
                room = max(0, self._rules.max_nodes - view.count(PARTICIPANTS))
                self._wait_for_change(
                    view,
                    gen,
                    deadline,
                    first=self._timing.poll_s + min(room, _MAX_BATCH_ESTIMATE) * _PER_INTENT_S,
                    horizon=max(1.0, takeover_at - time.monotonic()),
                )
                return
        else:
            # Takeover (the claim's winner died, or is slow): one more claim per slot of
            # the takeover time (wall-clock slots, the same on every node), so one node
            # merges per slot. No listing to find a turn: with N nodes pending, N
            # listings of N names after every merge was a formation-long O(N^2) storm.
            # A slow winner and a taker-over both merging is a compare-and-set race.
            slot_s = self._timing.takeover_s
            slot = int(time.time() // slot_s)
            if not board.claim(gen, slot=slot):
                next_slot = (slot + 1) * slot_s - time.time()
                self._wait_for_change(
                    view, gen, deadline, horizon=max(self._timing.poll_s, next_slot)
                )
                return
        board.release_claims(below=gen)
        # Gather: merge once the batch stops growing for a poll interval, or holds every
        # node the round can still take (one write for a simultaneous start).
        room = self._rules.max_nodes - view.count(PARTICIPANTS)
        names = board.names()
        while len(names) < room and time.monotonic() < deadline:
            time.sleep(self._timing.poll_s)
            grown = board.names()
            if len(grown) <= len(names):
                break
            names = grown
        full_gen, state = self._backend.read_full()
        members = state.members()
        nodes = [n for n in (board.read(name) for name in names) if n is not None]
        fresh = [n for n in nodes if n not in members or n in state.waiting]
        merged = merge(state, fresh, self._rules, generation=full_gen + 1)
        if merged and not self.write(state, full_gen):
            time.sleep(random.uniform(0, _SLOT_S * 4))

    def _wait_for_change(
        self,
        view: Readable,
        generation: int,
        deadline: float,
        first: float | None = None,
        horizon: float = 1.0,
    ) -> None:
        """Sleep until the generation changes, ``horizon`` passes or a timer is due.

        ``first``: the first poll delay (default ``poll_interval``), doubling up to
        0.25 s (or ``first``, if larger) after that.
        """
        now = time.monotonic()
        wake = min(now + horizon, deadline)
        elapsed = self._timer.elapsed(view)
        if elapsed is not None:
            t = self._timing
            for at in (t.last_call_s, t.grace_s, t.overdue_s):
                if at > elapsed:
                    wake = min(wake, now + at - elapsed + 0.005)
        delay = first or self._timing.poll_s
        cap = max(_POLL_CAP_S, delay)
        polls = 0
        while True:
            now = time.monotonic()
            if now >= wake:
                return
            time.sleep(min(delay, wake - now))
            delay = min(delay * 2, cap)
            polls += 1
            # One open of ``head`` per poll; every 4th poll also probes past it.
            if self._backend.latest_generation(probe=polls % 4 == 0) != generation:
                return
