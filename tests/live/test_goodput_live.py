"""``status --goodput`` on the event log of real in-place runs, checked against the ledger.

Two real agents (2 gloo workers each, examples/train_ddp.py) train together; one node is
SIGKILLed (a hard loss: the survivors' collective fails, they re-form in place at 2
workers and redo what they rolled back). The ledger (every attempt of every step, with
its round and start time) is the independent record the accounting must agree with.
"""

from __future__ import annotations

import collections
import itertools
import statistics
from pathlib import Path

import pytest

from slurm_elastic.agent import ExitCode
from slurm_elastic.cli.goodput import account
from slurm_elastic.events import LiveReformed, read_events
from tests.live.conftest import (
    TOGETHER_LAST_CALL_S,
    LiveRun,
    ledger,
    redone_steps,
    wait_world_of_4,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def _pace(records: list[dict]) -> float:
    """The median seconds per step of rank 0, between consecutive steps of one round."""
    rank0 = sorted((r for r in records if r["rank"] == 0), key=lambda r: r["time"])
    gaps = [
        b["time"] - a["time"]
        for a, b in itertools.pairwise(rank0)
        if b["step"] == a["step"] + 1 and b["round"] == a["round"]
    ]
    return statistics.median(gaps)


def test_goodput_of_a_hard_loss_in_place_agrees_with_the_ledger(
    tmp_path: Path, nodes: list[LiveRun]
) -> None:
    steps = 200
    together = {"steps": steps, "last_call_s": TOGETHER_LAST_CALL_S}  # round 0 holds both
    a = LiveRun(tmp_path, "gp1", "1:2", "a", "--commit-every", "5", **together)
    b = LiveRun(tmp_path, "gp1", "1:2", "b", "--commit-every", "5", **together)
    nodes += [a, b]
    wait_world_of_4(tmp_path, min_steps=30)
    b.kill_node()
    assert a.wait(150) == ExitCode.FINISHED, a.log()

    evs = list(read_events(tmp_path / "state" / "events" / "gp1"))
    g = account(evs)
    records = ledger(tmp_path)
    assert sum(g.seconds.values()) == pytest.approx(g.total_s, abs=1e-6)
    assert (g.first_step, g.last_step) == (0, steps)
    assert g.restarts == 0 and g.reformations == 1  # in place: no worker restarted
    # redone steps: what the re-formation says it rolled back; the ledger also counts the
    # step in flight when the peer died (started, never finished), so at most one more
    reformed = [e for e in evs if isinstance(e, LiveReformed) and e.rank == 0]
    assert g.redone_steps == sum(e.redone_steps for e in reformed)
    assert g.redone_steps <= redone_steps(records) <= g.redone_steps + 1
    # the re-formation took what the workers measured (switch_s), clipped to the gap
    # between the progress points around it: their stamps are steps, so the two agree
    # to within one step (a fresh-clone run: 0.094 s measured, 0.064 s booked)
    pace = _pace(records)
    assert g.seconds["re-formation"] >= max(e.switch_s for e in reformed) - pace
    # useful: the steps trained once at the run's pace (world 4 and world 2 pace alike:
    # the steps are paced by --step-time); lenient, 2 shared cores
    once = steps - g.redone_steps
    assert g.seconds["useful"] == pytest.approx(once * pace, rel=0.35)
    by_round = collections.Counter(r["round"] for r in records if r["rank"] == 0)
    assert len(by_round) >= 2  # it did re-form
