"""Which step boundaries vote (slurm_elastic.live.boundary.Cadence), and that the ranks
of a real gloo group agree on it: the vote carries each rank's proposal and the shortest
wins, so every rank skips the same boundaries without asking."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import socket
import time
from contextlib import closing
from typing import Any

import pytest
import torch
import torch.distributed as dist

from slurm_elastic.live.boundary import (
    MAX_STEPS_BETWEEN_VOTES,
    Cadence,
    Departure,
    cast_vote,
    start_vote,
    vote,
)


class FakeClock:
    """The seam: step durations set by the test instead of waited out."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _boundaries(c: Cadence, clock: FakeClock, first: int, last: int, round_: int,
                step_s: float) -> list[int]:  # fmt: skip
    """The steps in first..last whose boundary voted (agreeing on c's own proposal)."""
    voted = []
    for step in range(first, last + 1):
        clock.now += step_s
        if c.due(step, round_):
            voted.append(step)
            c.agreed(step, round_, c.proposal())
    return voted


def test_votes_come_about_every_interval_and_at_the_first_boundary_of_each_round() -> None:
    clock = FakeClock()
    c = Cadence(0.25, clock=clock)
    voted = _boundaries(c, clock, 1, 40, round_=3, step_s=0.05)
    assert voted[:2] == [1, 2]  # the first boundary of the round, then one to time a step
    gaps = {b - a for a, b in itertools.pairwise(voted[2:])}
    assert gaps == {5}, voted  # 0.25 s / 0.05 s per step
    # A switch to round 4 at step 41: its first boundary votes at once.
    assert _boundaries(c, clock, 41, 41, round_=4, step_s=0.05) == [41]


def test_slower_steps_vote_more_often_and_zero_means_every_boundary() -> None:
    clock = FakeClock()
    c = Cadence(0.25, clock=clock)
    _boundaries(c, clock, 1, 20, round_=1, step_s=0.01)
    assert c.proposal() == 25
    _boundaries(c, clock, 21, 200, round_=1, step_s=0.5)  # a step now takes 0.5 s
    assert c.proposal() == 1
    every = Cadence(0.0, clock=clock)
    assert _boundaries(every, clock, 1, 10, round_=1, step_s=0.001) == list(range(1, 11))


def test_a_change_under_way_votes_at_every_boundary_until_it_is_done() -> None:
    # A rank that waits for a new round (or has notice) proposes 1: the shortest
    # proposal wins, so every rank votes at the next boundary, and again, until the
    # change is done; then the cadence is back.
    clock = FakeClock()
    c = Cadence(1.0, clock=clock)
    _boundaries(c, clock, 1, 20, round_=1, step_s=0.1)
    assert c.proposal() == 10 and c.proposal(urgent=True) == 1
    urgent_votes = []
    for step in range(21, 60):
        clock.now += 0.1
        if c.due(step, 1):
            urgent_votes.append(step)
            c.agreed(step, 1, c.proposal(urgent=step < 40))
    assert [s for s in urgent_votes if s <= 40] == [*range(urgent_votes[0], 41)]
    assert urgent_votes[0] <= 30  # the vote the cadence had already fixed
    assert [s for s in urgent_votes if s > 40] == [50], urgent_votes  # 10 steps: 1.0 s


def test_a_very_short_step_is_capped() -> None:
    clock = FakeClock()
    c = Cadence(10.0, clock=clock)
    _boundaries(c, clock, 1, 3, round_=1, step_s=1e-6)
    assert c.proposal() == MAX_STEPS_BETWEEN_VOTES


def test_a_negative_interval_is_refused_with_its_value() -> None:
    with pytest.raises(ValueError, match=r"vote_interval_s=-1.0"):
        Cadence(-1.0)


def _rank(rank: int, port: int, step_s: float, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    clock = FakeClock()
    c = Cadence(0.25, clock=clock)
    voted = []
    try:
        for step in range(1, 61):
            clock.now += step_s  # each rank times its own steps differently
            if c.due(step, 0):
                agreed = vote(False, 0, False, torch.device("cpu"), c.proposal())
                c.agreed(step, 0, agreed.next_in)
                voted.append((step, agreed.next_in))
        out.put((rank, voted))
    finally:
        dist.destroy_process_group()


def _run_two_ranks(target: Any, *args_per_rank: tuple[Any, ...]) -> dict[int, Any]:
    """Run ``target(rank, port, *args, out)`` in two spawned gloo ranks; rank -> the rest
    of what each put on ``out``."""
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, *a, out)) for r, a in
             enumerate(args_per_rank)]  # fmt: skip
    for p in procs:
        p.start()
    got = {r[0]: r[1:] for r in (out.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return got


def test_two_ranks_that_time_their_steps_differently_vote_on_the_same_boundaries() -> None:
    got = {r: v[0] for r, v in _run_two_ranks(_rank, (0.01,), (0.05,)).items()}
    assert got[0] == got[1]  # a mismatch would have hung a rank in the collective
    # The slower rank's proposal (0.25 s / 0.05 s = 5 steps) wins, not rank 0's 25.
    assert {n for _, n in got[0][2:]} == {5}, got[0]


def _skewed_rank(rank: int, port: int, out: mp.Queue) -> None:
    """Rank 1's step takes 1 s, rank 0's 0.2 s (their compute, slept: the seam here is
    the step's length, not what fills it). How long rank 0 waits for the vote at its
    boundary, with the vote cast at the step's entry and at its end."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    step_s = 1.0 if rank else 0.2
    cpu = torch.device("cpu")
    try:
        dist.barrier()
        ballot = start_vote(rank == 1, 0, False, cpu)  # at the step's entry
        time.sleep(step_s)
        t0 = time.perf_counter()
        at_entry = ballot.result()
        waited_entry = time.perf_counter() - t0
        dist.barrier()
        time.sleep(step_s)
        t0 = time.perf_counter()
        at_end = vote(rank == 1, 0, False, cpu)  # cast at the boundary itself
        waited_end = time.perf_counter() - t0
        out.put((rank, at_entry, at_end, waited_entry, waited_end))
    finally:
        dist.destroy_process_group()


def test_a_vote_cast_at_the_steps_entry_does_not_wait_for_the_slower_rank() -> None:
    # Plain DDP pays the ranks' skew once, in its gradient all-reduce; a vote taken at
    # the boundary paid it a second time. Cast at the entry, its collective is done by
    # the boundary: the faster rank does not wait there for the slower one's step.
    got = _run_two_ranks(_skewed_rank, (), ())
    (entry0, end0, waited_entry, waited_end), (entry1, end1, _, _) = got[0], got[1]
    assert entry0 == entry1 == end0 == end1  # the same agreement on both ranks
    assert entry0.any_leave and entry0.any_stay  # rank 1 leaves, rank 0 stays
    assert waited_end >= 0.7, waited_end  # at the boundary: the 0.8-s skew
    assert waited_entry < 0.4, waited_entry  # cast at the entry: done by the boundary


def test_what_casting_a_vote_raised_is_raised_at_the_boundary() -> None:
    class BrokenWorld:
        """The seam: a world whose next round's store is unreachable (no group needed:
        the vote is never started)."""

        round = 1

        def ready_round(self) -> int:
            raise ConnectionError("round 2's store is gone")

    ballot = cast_vote(1, True, Departure(True, 60.0), Cadence(0.0), BrokenWorld())
    assert ballot is not None and ballot.leaving is False
    with pytest.raises(ConnectionError, match="round 2's store is gone"):
        ballot.result()
