"""The rendezvous rules (``slurm_elastic.rendezvous.decisions``), pure: no files, no torch.

Each case builds a :class:`State`, asks what a node does with a given :class:`Clock`
and checks the act and, applied, the change. The last-call timer runs on an injected
clock. A whole formation and re-formation is played by :func:`_play` (nodes take turns
deciding and applying, as the executor does, without any I/O).
"""

from __future__ import annotations

import pytest

from slurm_elastic.rendezvous.decisions import (
    Act,
    Clock,
    Rules,
    apply,
    decide_close,
    decide_exit,
    decide_join,
    decide_leave,
    evict,
    merge,
    moved_on_in_place,
    round_broken,
)
from slurm_elastic.rendezvous.executor import LastCallTimer
from slurm_elastic.rendezvous.state import Node, State, StateView, decode_state, encode_state

A, B, C, D = (Node(h, 1, 0) for h in ("a", "b", "c", "d"))
DUE = Clock(last_call_due=True, grace_passed=True)
GRACE = Clock(grace_passed=True)


def _join(state: State, node: Node, rules: Rules, clock: Clock | None = None) -> Act:
    clock = clock or Clock()
    act = decide_join(state, node, rules, clock)
    # The decision on a lazily read view of the same state is the same.
    payload = encode_state(state)
    view = StateView(lambda at, n: payload[at : at + n], len(payload))
    assert decide_join(view, node, rules, clock) is act
    return act


def _do(state: State, node: Node, act: Act, rules: Rules, gen: int = 7) -> State:
    apply(state, node, act, rules, gen)
    assert decode_state(encode_state(state)) == state  # every change stays encodable
    return state


def test_rules_refuse_bad_limits() -> None:
    with pytest.raises(ValueError, match="min_nodes=3, max_nodes=2"):
        Rules(3, 2)
    with pytest.raises(ValueError, match="min_nodes=0"):
        Rules(0, 2)


def test_first_nodes_join_and_the_last_call_starts_at_min_nodes() -> None:
    rules, s = Rules(2, 3), State()
    assert _join(s, A, rules) is Act.ADD_TO_PARTICIPANTS
    _do(s, A, Act.ADD_TO_PARTICIPANTS, rules)
    assert s.last_call is None and not s.complete
    assert _join(s, A, rules) is Act.SYNC  # alone: wait
    _do(s, B, Act.ADD_TO_PARTICIPANTS, rules)
    assert s.last_call == 1  # min reached: a last call, an id (no time)
    assert _join(s, A, rules) is Act.SYNC  # not due yet
    assert _join(s, A, rules, DUE) is Act.MARK_COMPLETE
    # Only the first participant completes (one writer), unless overdue.
    assert _join(s, B, rules, DUE) is Act.SYNC
    assert _join(s, B, rules, Clock(last_call_due=True, overdue=True)) is Act.MARK_COMPLETE
    _do(s, A, Act.MARK_COMPLETE, rules, gen=9)
    assert (s.complete, s.world, s.formed, s.last_call) == (True, 2, 9, None)
    assert _join(s, A, rules) is Act.FINISH and _join(s, B, rules) is Act.FINISH


def test_max_nodes_completes_at_once_and_ranks_follow_the_sort_order() -> None:
    rules, s = Rules(1, 3), State()
    for node in (C, A, B):
        _do(s, node, _join(s, node, rules), rules, gen=4)
    assert s.complete and s.world == 3 and s.formed == 4
    assert [s.index(n, 0) for n in (A, B, C)] == [0, 1, 2]


def test_a_late_node_waits_and_with_no_seat_is_a_spare() -> None:
    rules, s = Rules(1, 2), State()
    _do(s, A, Act.ADD_TO_PARTICIPANTS, rules)
    _do(s, A, Act.MARK_COMPLETE, rules)
    assert _join(s, B, rules) is Act.ADD_TO_WAITING  # a seat: the members re-form
    _do(s, B, Act.ADD_TO_WAITING, rules)
    assert _join(s, B, rules) is Act.SYNC
    _do(s, C, Act.ADD_TO_PARTICIPANTS, rules)  # a forming round...
    s.complete, s.world = True, 2  # ...now complete and full (as a merge leaves it)
    assert _join(s, B, rules) is Act.TO_SPARES  # else the members re-form forever
    _do(s, B, Act.TO_SPARES, rules)
    assert s.waiting == set() and s.spares == {B}
    assert _join(s, D, rules) is Act.ADD_TO_SPARES
    assert _join(s, B, rules, Clock(timed_out=True)) is Act.SYNC  # spares never time out
    _do(s, C, Act.REMOVE, rules)  # a seat opens
    assert _join(s, B, rules) is Act.LEAVE_SPARES


def test_a_timed_out_join_rolls_back_then_fails() -> None:
    rules, s = Rules(2, 3), State()
    _do(s, A, Act.ADD_TO_PARTICIPANTS, rules)
    late = Clock(timed_out=True)
    assert _join(s, A, rules, late) is Act.REMOVE
    _do(s, A, Act.REMOVE, rules)
    assert _join(s, A, rules, late) is Act.ERROR_TIMEOUT


def test_a_closed_run_admits_nobody() -> None:
    rules, s = Rules(1, 2), State()
    assert decide_close(s, Clock()) is Act.MARK_CLOSED
    _do(s, A, Act.MARK_CLOSED, rules)
    assert _join(s, A, rules) is Act.ERROR_CLOSED
    assert decide_close(s, Clock()) is Act.FINISH
    assert merge(s, [B], rules, 3) == []


def _complete(rules: Rules, *nodes: Node) -> State:
    s = State()
    for node in nodes:
        _do(s, node, Act.ADD_TO_PARTICIPANTS, rules)
    if not s.complete:
        _do(s, nodes[0], Act.MARK_COMPLETE, rules)
    return s


def test_reseat_reopens_the_round_with_every_member_seated() -> None:
    rules = Rules(2, 3)
    s = _complete(rules, A, B)
    _do(s, C, Act.ADD_TO_WAITING, rules)
    act = decide_exit(s, A, Clock(), seated_round=0, reseat=True)
    assert act is Act.RESEAT
    _do(s, A, act, rules)
    assert s.round == 1 and not s.complete and s.participants == {A, B}
    assert s.last_call is not None  # min reached: a last call at once
    # B, re-joining from round 0, finds itself seated in round 1: nothing to leave.
    assert decide_exit(s, B, Clock(), seated_round=0, reseat=True) is Act.FINISH
    # The newcomer joins the forming round; with everyone in, max completes it.
    assert _join(s, C, rules) is Act.ADD_TO_PARTICIPANTS
    _do(s, C, Act.ADD_TO_PARTICIPANTS, rules)
    assert s.complete and s.world == 3


def test_a_round_moved_on_in_place_is_told_from_one_that_lost_a_member() -> None:
    # The agent of workers still starting waits for them when its round moved on only
    # because a member re-joined in place for a newcomer; after a loss it restarts them.
    rules = Rules(1, 4)
    s = _complete(rules, A, B)
    assert not round_broken(s, None, None) and not moved_on_in_place(s, B, None, None)
    assert not round_broken(s, 0, 2) and not moved_on_in_place(s, B, 0, 2)
    _do(s, C, Act.ADD_TO_WAITING, rules)
    assert not round_broken(s, 0, 2)  # a newcomer waits: the round is whole
    _do(s, A, Act.RESEAT, rules)  # A's agent re-joins in place for C
    payload = encode_state(s)
    view = StateView(lambda at, n: payload[at : at + n], len(payload))
    for state in (s, view):
        assert round_broken(state, 0, 2) and moved_on_in_place(state, B, 0, 2)
    assert not moved_on_in_place(s, C, 0, 2)  # not seated: C waits
    _do(s, C, Act.ADD_TO_PARTICIPANTS, rules)
    assert moved_on_in_place(s, B, 0, 2)
    # A member evicted before the re-seat: the next round holds fewer nodes.
    lost = _complete(rules, A, B, D)
    evict(lost, [D], rules)
    _do(lost, A, Act.RESEAT, rules)
    assert round_broken(lost, 0, 3) and not moved_on_in_place(lost, B, 0, 3)
    _do(s, A, Act.MARK_CLOSED, rules)
    assert round_broken(s, 0, 2) and not moved_on_in_place(s, B, 0, 2)


def test_a_reformed_round_completes_after_the_grace_once_nobody_waits() -> None:
    rules = Rules(2, 4)
    s = _complete(rules, A, B)
    _do(s, A, Act.RESEAT, rules)
    assert _join(s, A, rules) is Act.SYNC  # within the grace
    assert _join(s, A, rules, GRACE) is Act.MARK_COMPLETE  # the last call is not due yet
    _do(s, D, Act.ADD_TO_WAITING, rules)
    assert _join(s, A, rules, GRACE) is Act.SYNC  # somebody waits: no early end


def test_a_restart_exits_as_torch_does() -> None:
    rules = Rules(1, 3)
    s = _complete(rules, A, B)
    assert decide_exit(s, A, Clock(), seated_round=0, reseat=False) is Act.REMOVE
    _do(s, A, Act.REMOVE, rules)
    assert s.complete and s.participants == {B}  # broken: fewer than its world
    _do(s, B, Act.REMOVE, rules)
    assert (s.round, s.complete, s.world) == (1, False, None)  # the last one out
    assert decide_exit(s, A, Clock(), seated_round=None, reseat=True) is Act.FINISH


def test_leave_removes_from_any_section_and_eviction_breaks_a_round() -> None:
    rules = Rules(1, 2)
    s = _complete(rules, A, B)
    _do(s, C, Act.ADD_TO_SPARES, rules)
    assert decide_leave(s, C, Clock()) is Act.REMOVE
    assert decide_leave(s, D, Clock()) is Act.FINISH
    assert decide_leave(s, A, Clock(timed_out=True)) is Act.ERROR_TIMEOUT
    assert evict(s, [B, C, D], rules)
    assert s.participants == {A} and s.spares == set() and s.world == 2
    assert not evict(s, [D], rules)


def test_a_forming_round_below_min_loses_its_last_call() -> None:
    rules = Rules(2, 4)
    s = State()
    for node in (A, B):
        _do(s, node, Act.ADD_TO_PARTICIPANTS, rules)
    assert s.last_call == 1
    evict(s, [B], rules)
    assert s.last_call is None
    _do(s, C, Act.ADD_TO_PARTICIPANTS, rules)
    assert s.last_call == 2  # a new last call: every node times it afresh


def test_merge_adds_each_node_as_its_own_join_would() -> None:
    rules = Rules(2, 3)
    s = State()
    assert merge(s, [A, B, C, D], rules, 5) == [A, B, C, D]
    # A, B, C fill the round (complete at max, in generation 5); D finds it full.
    assert s.complete and s.participants == {A, B, C} and s.spares == {D}
    assert s.formed == 5
    assert merge(s, [A], rules, 6) == []  # already in: nothing to write


def test_the_last_call_timer_runs_on_this_nodes_clock_from_its_first_sight() -> None:
    now = [100.0]
    timer = LastCallTimer(clock=lambda: now[0])
    s = State(participants={A, B}, last_call=3, calls=3)
    assert timer.elapsed(s) == 0.0
    now[0] = 101.5
    assert timer.elapsed(s) == 1.5
    s.last_call = 4  # a new last call: timed afresh
    assert timer.elapsed(s) == 0.0
    s.complete, s.world, s.formed, s.last_call = True, 2, 1, None
    assert timer.elapsed(s) is None


def _play(rules: Rules, nodes: list[Node], clock: Clock, state: State) -> State:
    """Nodes take turns deciding and applying until every one finishes (no I/O).

    First with no timer due (every node arrives within the last call), then ``clock``.
    """
    for turn in range(100):
        done = True
        for node in nodes:
            act = decide_join(state, node, rules, clock if turn > 10 else Clock())
            if act in (Act.FINISH, Act.SYNC):
                done = done and act is Act.FINISH
                continue
            apply(state, node, act, rules, 1)
            done = False
        if done:
            return state
    raise AssertionError(f"no fixed point: {state}")


def test_a_whole_formation_and_a_reformation_with_a_newcomer() -> None:
    rules = Rules(2, 3)
    s = _play(rules, [A, B], DUE, State())
    assert s.complete and s.participants == {A, B}
    _do(s, C, Act.ADD_TO_WAITING, rules)  # a late joiner: the members re-form in place
    for node in (A, B):
        act = decide_exit(s, node, Clock(), seated_round=0, reseat=True)
        if act is not Act.FINISH:
            _do(s, node, act, rules)
    s = _play(rules, [A, B, C], DUE, s)
    assert s.round == 1 and s.participants == {A, B, C} and s.world == 3
