"""``slurm-elastic status`` judges the run's saves against the window its agents recorded.

The recorded local run (tests/data/events/local-run) plus an ``agent.window`` event as an
agent on the local Slurm's partition ``low`` writes it (GraceTime 20 s, KillWait 5 s,
lead 120 s), then a slow save appended the way a worker emits it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_elastic import events as ev
from slurm_elastic.cli.main import main
from slurm_elastic.envvars import EVENTS_DIR_ENV

RUN = "local-8f6892ca29"


def _emit_into(run: Path, monkeypatch: pytest.MonkeyPatch, event: ev.Event) -> None:
    monkeypatch.setenv(EVENTS_DIR_ENV, str(run / "events" / RUN))
    ev.emit(event)


def test_status_without_a_window_event_says_nothing_about_it(
    recorded_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", str(recorded_run)]) == 0
    assert "preemption window" not in capsys.readouterr().out
    assert main(["status", str(recorded_run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["preemption_window"] is None


def test_status_shows_the_window_and_warns_when_the_save_no_longer_fits(
    recorded_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    window = ev.AgentWindow(
        signal_lead_s=120, grace_time_s=20, kill_wait_s=5, partition="low", shutdown_timeout_s=60
    )
    _emit_into(recorded_run, monkeypatch, window)
    assert main(["status", str(recorded_run)]) == 0
    out = capsys.readouterr().out
    assert "preemption window: preemption 25 s (GraceTime 20 s + KillWait 5 s" in out
    assert "fits" in out and "WARNING" not in out

    _emit_into(recorded_run, monkeypatch, ev.CheckpointSaved(step=310, path="/c/310", seconds=22.5))
    assert main(["status", str(recorded_run)]) == 0
    out = capsys.readouterr().out
    warning = [line for line in out.splitlines() if line.startswith("WARNING:")]
    assert len(warning) == 1, out
    assert "takes 22.5 s" in warning[0] and "preemption window of 25 s" in warning[0]
    assert "longer GraceTime on partition low" in warning[0]

    assert main(["status", str(recorded_run), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["preemption_window"]
    assert doc["save_s"] == 22.5 and doc["fits"] is False
    assert [w["case"] for w in doc["windows"]] == ["preemption", "time limit", "agent budget"]
    assert len(doc["problems"]) == 1
