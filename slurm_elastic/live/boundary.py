"""The step-boundary vote: how the ranks agree, at the end of a step, on what next.

The vote is cast at the entry of the step whose boundary reads it (:func:`start_vote`):
its collective runs while the step computes.

**At the step boundaries that vote** (:class:`Cadence`: the first of each round, then
about every ``vote_interval_s`` of training; each vote fixes the step of the next) the
ranks agree with one ``all_reduce`` (MAX over six integers): does any rank's node leave,
does any rank stay, which new round (if any) every staying rank has received *and* found
ready (all its ranks announced in the round's store), has a leave waited too long, and
how many steps until the next vote. Then, the same decision on every rank:

* nothing pending: commit (every ``commit_every`` steps), maybe checkpoint, go on;
* every staying rank holds the same ready round: **switch** (graceful join, leave, spare
  promotion): leaving ranks return, the others commit, tear the group down in the safe
  order, init the new group on the round's store, take the newest commit from a
  survivor by broadcast (newcomers: no disk read), and wrap the model in a new DDP;
* every rank leaves (the whole job is preempted): save a checkpoint together, return;
* restart path (``$SLURM_ELASTIC_IN_PLACE=0``, or no agent node channel): a notice
  makes all ranks save together, the leaving ranks return, the others wait for the
  agent to restart them.

:class:`Departure` is this rank's side of the vote (does it leave, has a leave waited
too long), :func:`vote` the collective and :class:`Agreement` what every rank learns
from it; acting on it is :class:`~slurm_elastic.live.session.ElasticSession`'s.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from slurm_elastic import notice

__all__ = ["Agreement", "Ballot", "Cadence", "Departure", "cast_vote", "start_vote", "vote"]

log = logging.getLogger(__name__)

_BIG = 1 << 62

#: Never more steps than this between two votes, however short the steps.
MAX_STEPS_BETWEEN_VOTES = 1000


class Departure:
    """Whether this rank leaves at the next boundary, and how long a leave has waited.

    A rank leaves when its node has notice, when its node has no place in the newest
    round (:attr:`not_in_round`: a spare), or, in place, when the agent that started it is
    gone (SIGKILL does not take the children along): then it leaves instead of training
    on as an orphan.
    """

    def __init__(self, in_place: bool, leave_wait_s: float) -> None:
        self.leave_wait_s = leave_wait_s
        #: when this rank first saw some rank leave (None: no leave pending)
        self.seen_at: float | None = None
        #: this node has no place in the newest round
        self.not_in_round = False
        #: the process that started this worker (its agent), on both paths
        self.parent_pid = os.getppid()
        self._agent_pid = self.parent_pid if in_place else None  # in place: leave if gone
        self._orphaned = False

    def leaving_here(self) -> bool:
        """Whether this rank's node leaves."""
        if self._agent_pid is not None and not self._orphaned and os.getppid() != self._agent_pid:
            log.warning("agent %d is gone: leaving at the switch", self._agent_pid)
            self._orphaned = True
        return self._orphaned or self.not_in_round or notice.preemption_requested()

    def waited_too_long(self) -> bool:
        """A leave was seen more than ``leave_wait_s`` ago and no switch came."""
        return self.seen_at is not None and time.monotonic() - self.seen_at > self.leave_wait_s

    def saw_leave(self) -> None:
        """Some rank leaves: start the wait (once)."""
        if self.seen_at is None:
            self.seen_at = time.monotonic()

    def reset(self) -> None:
        """The world changed: no leave is pending any more."""
        self.seen_at = None


class Cadence:
    """Which step boundaries vote: the first of every round, then about every
    ``interval_s`` seconds.

    A vote is a collective, so it costs a synchronisation of the ranks (and, on a GPU,
    a wait for the step's kernels) at each boundary that holds one. Each vote fixes the
    step of the next from the ranks' recent step times (the shortest interval any rank
    proposes wins), so every rank knows which boundaries vote without asking. A new
    round (a switch or a recovery) always votes at its first boundary.

    Args:
        interval_s: seconds of training between votes; 0: every boundary.
        clock: the monotonic clock.

    Raises:
        ValueError: ``interval_s`` negative.
    """

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not interval_s >= 0:
            raise ValueError(f"vote_interval_s={interval_s!r}: must be >= 0 seconds")
        self.interval_s = interval_s
        self._clock = clock
        self._round: int | None = None
        self._next = 0
        self._last: float | None = None
        self._step_s: float | None = None

    def due(self, step: int, round_: int) -> bool:
        """Whether the boundary after ``step`` (in round ``round_``) votes."""
        now = self._clock()
        if self._last is not None and self._round == round_:
            took = now - self._last
            self._step_s = took if self._step_s is None else 0.8 * self._step_s + 0.2 * took
        self._last = now
        return self._round != round_ or step >= self._next

    def proposal(self, urgent: bool = False) -> int:
        """Steps until the next vote, as this rank's step times have it; 1 when
        ``urgent`` (a change under way here: a notice, a leave seen, a new round this
        rank waits for), so a change, once seen at a vote, is not held up by the cadence."""
        if urgent or self.interval_s <= 0 or not self._step_s:
            return 1
        return max(1, min(MAX_STEPS_BETWEEN_VOTES, round(self.interval_s / self._step_s)))

    def agreed(self, step: int, round_: int, steps: int) -> None:
        """The vote after ``step`` fixed the next one ``steps`` later."""
        self._round, self._next = round_, step + max(1, steps)


@dataclass(frozen=True)
class Agreement:
    """The outcome of one boundary vote, the same on every rank.

    Attributes:
        any_leave: some rank's node leaves.
        any_stay: some rank stays.
        ready_max: the newest round a staying rank holds and found ready, plus one
            (0: none).
        ready_min: the oldest such round over the staying ranks, plus one.
        gave_up: some rank's leave has waited longer than ``leave_wait_s``.
        next_in: steps until the next vote (the shortest any rank proposed).
    """

    any_leave: bool
    any_stay: bool
    ready_max: int
    ready_min: int
    gave_up: bool
    next_in: int = 1

    @property
    def everyone_leaves(self) -> bool:
        """Every rank leaves: the whole job stops."""
        return self.any_leave and not self.any_stay

    @property
    def switch(self) -> bool:
        """Every staying rank holds the same ready round: switch to it."""
        return self.ready_max > 0 and self.ready_min == self.ready_max


#: Votes of failed steps whose collective had not ended (see :meth:`Ballot.abandon`).
_UNFINISHED: list[Ballot] = []


@dataclass
class Ballot:
    """This rank's vote for a step's boundary, started at the step's entry.

    The vote's ``all_reduce`` runs while the step computes: by the boundary the slower
    rank has long cast its own, so the boundary does not wait for the ranks' skew (plain
    DDP pays that skew once, in its gradient all-reduce; a vote taken at the boundary was
    a second synchronisation per voting step). It carries what this rank knew at the
    step's entry; a change seen during the step is voted on at the next vote.

    Attributes:
        leaving: this rank voted to leave (what it acts on at the boundary).
    """

    leaving: bool
    flags: torch.Tensor
    work: Any
    #: what casting the vote raised: raised at the boundary, where failures are handled
    error: Exception | None = None

    def abandon(self) -> None:
        """The step failed before its boundary read the vote: keep the vote referenced
        until a later vote (which prunes those whose collective has ended).

        A gloo thread that drops the second-to-last C++ reference to a tensor made in
        Python takes the GIL to release its Python object; if the group is freed first
        (its destructor joins that thread, holding the GIL: e.g. when the loop drops the
        old DDP wrapper), both wait forever. Kept here, the work's own references
        outlive the thread's: even a completed one (the thread lets go of the work just
        after it completes it). The failed group's connections are shut down right
        after (:func:`~slurm_elastic.live.links.abandon`), so the collective ends.
        """
        if self.work is not None:
            _UNFINISHED.append(self)

    def result(self) -> Agreement:
        """Wait for the vote (usually done already) and return what the ranks agree on.

        Raises:
            Exception: what casting it raised (a peer failure, typically).
        """
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        self.work.wait()
        any_leave, any_stay, ready_max, neg_min, gave_up, neg_next = (
            int(v) for v in self.flags.tolist()
        )
        return Agreement(
            any_leave=bool(any_leave),
            any_stay=bool(any_stay),
            ready_max=ready_max,
            ready_min=-neg_min,
            gave_up=bool(gave_up),
            next_in=-neg_next,
        )


def start_vote(
    leaving: bool, ready: int, give_up: bool, device: torch.device, next_in: int = 1
) -> Ballot:
    """Collective (started, not waited for): this rank's vote; :meth:`Ballot.result` is
    what the ranks agree on. Every rank starts it at the same point of the same step.

    Args:
        leaving: this rank's node leaves.
        ready: the round this rank holds and found ready, plus one (0: none, and always
            0 for a leaving rank).
        give_up: this rank has seen a leave wait longer than ``leave_wait_s``.
        device: where the collective's tensor lives.
        next_in: this rank's proposal for the steps until the next vote.
    """
    flags = torch.tensor(
        [
            int(leaving),
            int(not leaving),
            ready,
            -_BIG if leaving else -ready,
            int(give_up),
            -next_in,
        ],
        dtype=torch.int64,
        device=device,
    )
    work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)
    return Ballot(leaving=leaving, flags=flags, work=work)


def vote(
    leaving: bool, ready: int, give_up: bool, device: torch.device, next_in: int = 1
) -> Agreement:
    """Collective: this rank's vote, and what the ranks agree on (:func:`start_vote`,
    waited for at once)."""
    return start_vote(leaving, ready, give_up, device, next_in).result()


def cast_vote(
    step: int, in_place: bool, departure: Departure, cadence: Cadence, world: Any
) -> Ballot | None:
    """At the entry of ``step``: the vote of its boundary, started (collective; see
    :class:`Ballot`), or None where that boundary does not vote. Raises nothing: what
    casting it raised, the ballot raises at the boundary (a step must run once entered).

    ``world``: the session's :class:`~slurm_elastic.live.world.LiveWorld` (its round, the
    pending and ready rounds, the collective's device).
    """
    _UNFINISHED[:] = [b for b in _UNFINISHED if not b.work.is_completed()]
    if not cadence.due(step, world.round):
        return None
    leaving = departure.leaving_here()
    try:
        if in_place:
            ready = 0 if leaving else world.ready_round()
            give_up = departure.waited_too_long()
        else:
            ready, give_up = 0, leaving  # restart path: a notice stops everyone at once
        waiting = departure.seen_at is not None or world.pending_round() is not None
        urgent = leaving or waiting  # vote again at the next boundary: a change is under way
        return start_vote(leaving, ready, give_up, world.device(), cadence.proposal(urgent))
    except Exception as exc:  # the step still runs; its boundary raises it
        return Ballot(leaving=leaving, flags=torch.empty(0), work=None, error=exc)
