"""The rendezvous rules: what a node does next, and what that does to the state.

Pure: no files, no threads, no clock. Each ``decide_*`` function takes the state as this
node read it (a :class:`~.state.State` or a :class:`~.state.StateView`: only the header
and this node's row are consulted), the node, the :class:`Rules` and what the node's own
monotonic clock says (:class:`Clock`: is the operation past its deadline, is the last
call due, has the re-formation grace passed) and returns an :class:`Act`. :func:`apply`
makes an act's change on a whole :class:`~.state.State`; :func:`evict` and
:func:`merge` are the changes a node makes on behalf of others. The executor
(:mod:`.executor`) reads, decides, applies and writes with a compare-and-set.

The rules (torch's dynamic rendezvous, with our changes marked *ours*):

* **join**: a node not in a forming round joins its participants; when they reach
  ``min_nodes`` a *last call* starts, at ``max_nodes`` the round completes at once; once
  the last call is due the round completes (ranks = sorted order). A node finding the
  round complete waits on the *waiting* list when there is room (the members re-form
  to take it in), else as a *spare*; a spare re-enters once a seat opens. *Ours*: only
  the first participant in sort order completes a round (one writer, not N); a round
  after the first completes as soon as nobody is waiting and the re-formation grace
  passed (the members are all seated already); a waiting node that finds the round
  complete and full moves to the spares at once (else the members re-form forever).
* **exit** (before joining again): a member leaves its completed round. *Ours*
  (``reseat``, an in-place change whose workers still train): it reopens the round as
  the next one with every member seated (:data:`Act.RESEAT`, one write), so newcomers
  get only the seats left; a member another member already re-seated stays.
* **leave**: remove this node from every section (graceful leave, not closing the run).
* **close**: mark the run closed.
* **evict**: remove dead nodes (found by the heartbeat ring).
* **merge**: add the nodes of pending join intents, each as join would.

Removing a participant from a complete round leaves the round broken (fewer
participants than its ``world``: every member re-forms); the last one out of a complete
round opens the next round; a forming round that falls below ``min_nodes`` loses its
last call.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from slurm_elastic.rendezvous.state import PARTICIPANTS, SPARES, WAITING, Node, State

__all__ = [
    "Act",
    "Clock",
    "Readable",
    "Rules",
    "apply",
    "decide_close",
    "decide_exit",
    "decide_join",
    "decide_leave",
    "evict",
    "merge",
]  # fmt: skip


class Readable(Protocol):
    """What the decisions read: :class:`~.state.State` and :class:`~.state.StateView`."""

    round: int
    complete: bool
    closed: bool
    last_call: int | None
    world: int | None
    formed: int | None

    def count(self, section: int) -> int: ...

    def where(self, node: Node) -> int | None: ...

    def index(self, node: Node, section: int) -> int | None: ...

    def node_at(self, section: int, index: int) -> Node: ...


class Act(enum.Enum):
    """What a node does next."""

    FINISH = "finish"  # done: nothing to change
    SYNC = "sync"  # wait for the state to change (or a timer)
    ERROR_CLOSED = "closed"
    ERROR_TIMEOUT = "timeout"
    ADD_TO_PARTICIPANTS = "add-participant"
    ADD_TO_WAITING = "add-waiting"
    ADD_TO_SPARES = "add-spare"
    TO_SPARES = "to-spares"  # waiting -> spares: the round is complete and full
    LEAVE_SPARES = "leave-spares"  # a seat opened: join again (with a fresh deadline)
    REMOVE = "remove"  # from whichever section holds the node
    MARK_COMPLETE = "complete"
    MARK_CLOSED = "close"
    RESEAT = "reseat"  # reopen this member's complete round with its members seated


#: The acts that add a node: posted as join intents and merged (:mod:`.join_intents`).
JOIN_ACTS = frozenset({Act.ADD_TO_PARTICIPANTS, Act.ADD_TO_WAITING, Act.ADD_TO_SPARES})


@dataclass(frozen=True)
class Rules:
    """The run's limits: ``min_nodes``..``max_nodes`` per round."""

    min_nodes: int
    max_nodes: int

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(
                f"min_nodes={self.min_nodes}, max_nodes={self.max_nodes}: need "
                "1 <= min_nodes <= max_nodes"
            )


@dataclass(frozen=True)
class Clock:
    """What this node's monotonic clock says about the operation and the last call.

    Attributes:
        timed_out: the operation's deadline passed.
        last_call_due: the current last call has lasted its timeout (this node's view).
        grace_passed: the current last call has lasted the re-formation grace.
        overdue: the current last call is so far past due that any participant, not
            only the first, completes the round (the first one is gone or slow).
    """

    timed_out: bool = False
    last_call_due: bool = False
    grace_passed: bool = False
    overdue: bool = False


def _completer(state: Readable, node: Node, clock: Clock) -> bool:
    """Whether ``node`` completes the round: the first participant, or any when overdue."""
    return clock.overdue or (
        state.count(PARTICIPANTS) > 0 and state.node_at(PARTICIPANTS, 0) == node
    )


def decide_join(state: Readable, node: Node, rules: Rules, clock: Clock) -> Act:
    """The next act of ``node`` joining the next complete round."""
    if state.closed:
        return Act.ERROR_CLOSED
    where = state.where(node)
    n = state.count(PARTICIPANTS)
    if state.complete and where == WAITING and n >= rules.max_nodes and not clock.timed_out:
        return Act.TO_SPARES
    if (
        not state.complete
        and state.round > 0
        and state.last_call is not None
        and state.count(WAITING) == 0
        and where == PARTICIPANTS
        and n >= rules.min_nodes
        and clock.grace_passed
        and _completer(state, node, clock)
    ):
        return Act.MARK_COMPLETE
    if where == SPARES:
        # No timeout as a spare: it may wait for a seat as long as the run lasts.
        return Act.SYNC if n >= rules.max_nodes else Act.LEAVE_SPARES
    if state.complete and where == PARTICIPANTS:
        return Act.FINISH
    if clock.timed_out:
        # Roll back what this node added, then give up.
        return Act.REMOVE if where in (PARTICIPANTS, WAITING) else Act.ERROR_TIMEOUT
    if state.complete:
        if where is None:
            return Act.ADD_TO_WAITING if n < rules.max_nodes else Act.ADD_TO_SPARES
        return Act.SYNC
    if where == PARTICIPANTS:
        if (
            rules.min_nodes <= n <= rules.max_nodes
            and state.last_call is not None
            and clock.last_call_due
            and _completer(state, node, clock)
        ):
            return Act.MARK_COMPLETE
        return Act.SYNC
    return Act.ADD_TO_PARTICIPANTS


def decide_exit(
    state: Readable, node: Node, clock: Clock, *, seated_round: int | None, reseat: bool
) -> Act:
    """The next act of ``node`` leaving the round it last completed, before joining again.

    Args:
        seated_round: the round this node last completed (None: none yet).
        reseat: keep the round's members seated (in place) instead of leaving it.
    """
    member = state.where(node) == PARTICIPANTS
    if seated_round is not None and not state.closed and member:
        if state.round > seated_round:
            return Act.FINISH  # another member re-seated this node in a later round
        if reseat:
            if clock.timed_out:
                return Act.ERROR_TIMEOUT
            if state.round == seated_round and state.complete:
                return Act.RESEAT
    if member:
        return Act.ERROR_TIMEOUT if clock.timed_out else Act.REMOVE
    return Act.FINISH


def decide_leave(state: Readable, node: Node, clock: Clock) -> Act:
    """The next act of ``node`` leaving the run (without closing it)."""
    where = state.where(node)
    if where is None:
        return Act.FINISH
    if where == PARTICIPANTS and clock.timed_out:
        return Act.ERROR_TIMEOUT
    return Act.REMOVE


def decide_close(state: Readable, clock: Clock) -> Act:
    """The next act of a node closing the run."""
    if state.closed:
        return Act.FINISH
    return Act.ERROR_TIMEOUT if clock.timed_out else Act.MARK_CLOSED


# -- changes ---------------------------------------------------------------------------------


def _start_last_call(state: State) -> None:
    state.calls += 1
    state.last_call = state.calls


def _complete(state: State, generation: int) -> None:
    state.complete = True
    state.last_call = None
    state.world = len(state.participants)
    state.formed = generation


def _remove_participant(state: State, node: Node, rules: Rules) -> None:
    state.participants.discard(node)
    if state.complete:
        if not state.participants:  # the last one out opens the next round
            state.complete = False
            state.round += 1
            state.world = state.formed = None
    elif len(state.participants) < rules.min_nodes:
        state.last_call = None


def apply(state: State, node: Node, act: Act, rules: Rules, generation: int) -> None:
    """Make ``act`` of ``node`` on ``state`` (whole, mutable).

    Args:
        generation: the generation this change will be published as (recorded as the
            round's ``formed`` when it completes the round).

    Raises:
        ValueError: ``act`` changes nothing (FINISH, SYNC, errors).
    """
    if act is Act.ADD_TO_PARTICIPANTS:
        state.waiting.discard(node)
        state.spares.discard(node)
        state.participants.add(node)
        n = len(state.participants)
        if n == rules.min_nodes:
            _start_last_call(state)
        if n >= rules.max_nodes:
            _complete(state, generation)
    elif act is Act.ADD_TO_WAITING:
        state.spares.discard(node)
        state.waiting.add(node)
    elif act is Act.ADD_TO_SPARES or act is Act.TO_SPARES:
        state.waiting.discard(node)
        state.spares.add(node)
    elif act is Act.LEAVE_SPARES:
        state.spares.discard(node)
    elif act is Act.REMOVE:
        if node in state.participants:
            _remove_participant(state, node, rules)
        state.waiting.discard(node)
        state.spares.discard(node)
    elif act is Act.MARK_COMPLETE:
        _complete(state, generation)
    elif act is Act.MARK_CLOSED:
        state.closed = True
    elif act is Act.RESEAT:
        state.round += 1
        state.complete = False
        state.world = state.formed = state.last_call = None
        if len(state.participants) >= rules.min_nodes:
            _start_last_call(state)
        if len(state.participants) >= rules.max_nodes:
            _complete(state, generation)
    else:
        raise ValueError(f"{act} does not change the state")


def evict(state: State, dead: Iterable[Node], rules: Rules) -> bool:
    """Remove ``dead`` nodes from every section; whether anything changed."""
    changed = False
    for node in dead:
        if state.where(node) is not None:
            apply(state, node, Act.REMOVE, rules, generation=0)
            changed = True
    return changed


def merge(state: State, nodes: Iterable[Node], rules: Rules, generation: int) -> list[Node]:
    """Add each of ``nodes`` (pending join intents) as its own join would.

    Returns:
        The nodes that changed the state (empty: nothing to write).
    """
    applied: list[Node] = []
    if state.closed:
        return applied
    for node in nodes:
        act = decide_join(state, node, rules, Clock())
        if act in JOIN_ACTS:
            apply(state, node, act, rules, generation)
            applied.append(node)
    return applied


def round_broken(state: Readable, round_: int | None, world: int | None) -> bool:
    """Whether round ``round_`` of ``world`` nodes, last joined, lost a member, moved on,
    or the run closed (``False`` before any round was joined). In a complete round
    participants are only ever removed (a newcomer waits), so the round is whole while
    it is the same round with as many participants."""
    if round_ is None or world is None:
        return False
    return (
        state.closed
        or state.round != round_
        or not state.complete
        or state.count(PARTICIPANTS) != world
    )


def moved_on_in_place(state: Readable, node: Node, round_: int | None, world: int | None) -> bool:
    """Whether ``node``'s round ``round_`` (of ``world`` nodes) moved on with no member
    lost: a member re-joined with the seats kept (``RESEAT``: every member seated in the
    next round, newcomers added), ``node`` is seated there, and the round holds at least
    ``world`` nodes. A member evicted before the re-seat is not seated: fewer nodes."""
    if round_ is None or world is None or state.closed:
        return False
    return (
        state.round > round_
        and state.where(node) == PARTICIPANTS
        and state.count(PARTICIPANTS) >= world
    )
