"""``status --goodput`` (slurm_elastic.cli.goodput) on the event log of a real run.

tests/data/events/local-run is the recording of a real local run on the restart path
(3 agents, one preempted at step 29, the two others restarted their workers at 2 nodes
from the step-29 checkpoint, a replacement joined and all restarted at 3 from the step-50
checkpoint although step 60 had been reached: 10 steps redone; 300 steps). The expected
values below are read off its events independently of the accounting (times of the
events that bound each phase). A real in-place run is in tests/live/test_goodput_live.py.
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest

from slurm_elastic import events as ev
from slurm_elastic.cli.goodput import CATEGORIES, account
from slurm_elastic.cli.main import main

RUN = "local-8f6892ca29"


def _events(run: Path) -> list[ev.Event]:
    return list(ev.read_events(run / "events" / RUN))


def _first(evs: list[ev.Event], kind: type, after: float = 0.0) -> float:
    return next(e.time for e in evs if isinstance(e, kind) and e.time > after)


def test_every_second_of_the_recorded_run_is_booked_once(recorded_run: Path) -> None:
    evs = _events(recorded_run)
    g = account(evs)
    assert g.start == evs[0].time and g.end == evs[-1].time
    assert sum(g.seconds.values()) == pytest.approx(g.total_s, abs=1e-6)
    assert list(g.seconds) == list(CATEGORIES)
    spans = sorted(g.spans, key=lambda s: s.start)  # the time line has no hole or overlap
    assert spans[0].start == g.start and spans[-1].end == g.end
    assert all(a.end == pytest.approx(b.start) for a, b in itertools.pairwise(spans))


def test_the_recorded_runs_phases_match_its_events(recorded_run: Path) -> None:
    evs = _events(recorded_run)
    g = account(evs)
    t0 = evs[0].time
    # start-up: first agent start -> first train.start (rendezvous, workers, imports)
    assert g.seconds["start-up"] == pytest.approx(_first(evs, ev.TrainStart) - t0, abs=1e-6)
    # two restarts of the world's workers: each from the round's first workers_started
    # to the restarted workers' train.start
    restarts = []
    for restart in [e.time for e in evs if isinstance(e, ev.AgentRestart)][::2]:
        started = _first(evs, ev.WorkersStarted, restart)
        restarts.append(_first(evs, ev.TrainStart, started) - started)
    assert g.restarts == 2
    assert g.seconds["restarts"] == pytest.approx(sum(restarts), abs=1e-6)
    # 10 steps redone (60 reached, restarted from the step-50 checkpoint), at the pace of
    # the stretch they were trained in
    assert (g.first_step, g.last_step, g.redone_steps) == (0, 300, 10)
    progress = [e for e in evs if isinstance(e, ev.TrainProgress)]
    pace = statistics.median(
        (b.time - a.time) / (b.step - a.step)
        for a, b in itertools.pairwise(progress)
        if b.step > a.step
    )
    assert g.seconds["redone steps"] == pytest.approx(10 * pace, rel=0.15)
    # useful: the 290 steps trained once, at that pace
    assert g.seconds["useful"] == pytest.approx(290 * pace, rel=0.1)
    stalls = {e.step: e.stall_seconds for e in evs if isinstance(e, ev.CheckpointSaved)}
    assert g.seconds["checkpoint stalls"] <= sum(stalls.values()) + 1e-9
    assert g.seconds["queue wait"] == 0  # an agent was alive throughout
    # wind-down: the last step -> the last agent's exit
    last_step = max(e.time for e in evs if isinstance(e, ev.TrainDone | ev.TrainProgress))
    assert g.seconds["wind-down"] == pytest.approx(evs[-1].time - last_step, abs=1e-6)


def test_status_goodput_prints_the_breakdown_and_json(
    recorded_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", str(recorded_run), "--goodput"]) == 0
    out = capsys.readouterr().out
    assert f"goodput of run {RUN}: 79.7 s wall-clock" in out
    for name in CATEGORIES:
        assert f"  {name} " in out
    assert "steps 0 -> 300, 10 redone; 2 restart(s) of the workers" in out

    assert main(["status", str(recorded_run), "--goodput", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "slurm-elastic.goodput/1" and doc["state"] == "COMPLETED"
    assert doc["steps"] == {"first": 0, "last": 300, "redone": 10}
    assert doc["useful_s"] + doc["lost_s"] == pytest.approx(doc["total_s"])
    assert 0 < doc["efficiency"] < 1


def test_goodput_and_watch_are_refused_together(
    recorded_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", str(recorded_run), "--goodput", "--watch"]) == 2
    assert "takes no --watch" in capsys.readouterr().err


def test_a_whole_job_requeue_books_queue_wait_while_no_agent_is_alive() -> None:
    """Hand-written (no local run requeues a whole job): agents gone 100 s, then back."""
    evs = [
        ev.AgentStart(time=0.0, host="h", pid=1),
        ev.WorkersStarted(time=1.0, host="h", pid=1),
        ev.TrainStart(time=5.0, host="h", pid=2, step=0),
        ev.TrainProgress(time=15.0, host="h", pid=2, step=10),
        ev.AgentExit(time=17.0, host="h", pid=1, code="PREEMPTED_REQUEUED"),
        ev.AgentStart(time=117.0, host="h", pid=3),
        ev.WorkersStarted(time=118.0, host="h", pid=3),
        ev.TrainStart(time=122.0, host="h", pid=4, step=10),
        ev.TrainProgress(time=132.0, host="h", pid=4, step=20),
        ev.AgentExit(time=133.0, host="h", pid=3, code="FINISHED"),
    ]
    g = account(evs)
    assert g.seconds["queue wait"] == 100.0
    assert g.seconds["re-formation"] == 2.0 + 1.0  # 15->17 leaving, 117->118 round
    assert g.seconds["restarts"] == 4.0 and g.seconds["start-up"] == 5.0
    assert g.seconds["useful"] == 20.0 and g.seconds["wind-down"] == 1.0
    assert sum(g.seconds.values()) == g.total_s == 133.0


def test_hostile_step_numbers_do_not_make_the_accounting_loop() -> None:
    """Steps come from files anyone in the run directory could write: a step of 2**62 must
    cost no more than any other (no loop over the step range)."""
    huge = 2**62
    evs = [
        ev.AgentStart(time=0.0, host="h", pid=1),
        ev.TrainStart(time=1.0, host="h", pid=2, step=0),
        ev.CheckpointSaved(time=2.0, host="h", pid=2, step=huge // 2, stall_seconds=0.5),
        ev.TrainProgress(time=3.0, host="h", pid=2, step=huge),
        ev.TrainStart(time=4.0, host="h", pid=3, step=-huge),
        ev.TrainProgress(time=5.0, host="h", pid=3, step=huge),
    ]
    g = account(evs)
    assert sum(g.seconds.values()) == pytest.approx(g.total_s) == 5.0
    assert g.seconds["checkpoint stalls"] == 0.5
