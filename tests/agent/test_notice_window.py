"""The preemption-window planner (slurm_elastic.slurm.window) and the agent's start check.

Pure tests first (numbers in, verdict out), then the site parsers on output recorded from
the local Slurm 22.05, then the same against the live local cluster's scontrol, and the
agent's check (slurm_elastic.agent.notice_window) reading it and earlier saves.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from slurm_elastic import events
from slurm_elastic.config import load_config
from slurm_elastic.envvars import EVENTS_DIR_ENV, SIGNAL_LEAD_ENV
from slurm_elastic.slurm.env import SlurmEnv
from slurm_elastic.slurm.site import (
    PartitionInfo,
    parse_duration_s,
    parse_key_values,
    parse_partition,
)
from slurm_elastic.slurm.window import (
    MARGIN_S,
    NoticeWindow,
    plan_window,
    save_estimate,
    window_from_site,
)
from tests.conftest import SlurmCluster

DATA = Path(__file__).resolve().parent.parent / "data" / "slurm"
LOCAL = NoticeWindow(signal_lead_s=120, grace_time_s=20, kill_wait_s=5, partition="low")


def _case(verdict, name):  # type: ignore[no-untyped-def]
    return next(c for c in verdict.cases if c.name == name)


# -- pure ------------------------------------------------------------------------------------


def test_each_window_is_notice_to_sigkill() -> None:
    verdict = plan_window(LOCAL, shutdown_timeout_s=60, save_s=None)
    assert _case(verdict, "preemption").seconds == 25  # GraceTime 20 + KillWait 5
    assert _case(verdict, "time limit").seconds == 125  # lead 120 + KillWait 5
    assert _case(verdict, "agent budget").seconds == 60
    assert verdict.fits is None and verdict.misfits == ()
    assert "no checkpoint save measured yet" in verdict.summary()


def test_a_save_that_fits_every_window_has_no_problems() -> None:
    verdict = plan_window(LOCAL, 60, save_s=25 - MARGIN_S)
    assert verdict.fits is True and verdict.problems() == []
    assert "the checkpoint save (20.0 s) fits" in verdict.summary()


def test_a_save_longer_than_grace_plus_killwait_names_gracetime_of_the_partition() -> None:
    verdict = plan_window(LOCAL, 60, save_s=21)
    assert verdict.fits is False
    assert [c.name for c in verdict.misfits] == ["preemption"]
    (problem,) = verdict.problems()
    assert "takes 21.0 s" in problem and "preemption window of 25 s" in problem
    assert "GraceTime 20 s + KillWait 5 s (partition low)" in problem
    assert "longer GraceTime on partition low" in problem


def test_the_time_limit_window_names_signal_lead_s_and_the_budget_shutdown_timeout_s() -> None:
    window = NoticeWindow(signal_lead_s=30, grace_time_s=300, kill_wait_s=10, partition="p")
    verdict = plan_window(window, shutdown_timeout_s=40, save_s=50)
    problems = " | ".join(verdict.problems())
    assert {c.name for c in verdict.misfits} == {"time limit", "agent budget"}
    assert "raise signal_lead_s in the job file (now 30 s)" in problems
    assert "raise shutdown_timeout_s (now 40 s)" in problems


def test_a_partition_that_is_not_preemptable_has_no_preemption_window() -> None:
    window = NoticeWindow(signal_lead_s=120, grace_time_s=0, kill_wait_s=5, preemptable=False)
    verdict = plan_window(window, 60, save_s=10)
    assert [c.name for c in verdict.cases] == ["time limit", "agent budget"]
    assert verdict.fits is True


def test_unknown_settings_are_said_and_their_window_left_out() -> None:
    verdict = plan_window(NoticeWindow(), 60, save_s=70)
    assert [c.name for c in verdict.cases] == ["agent budget"]
    assert verdict.unknown == ("KillWait", "GraceTime", "the --signal lead (signal_lead_s)")
    assert "not known: KillWait" in verdict.summary()


def test_the_save_estimate_is_the_longest_recent_save() -> None:
    assert save_estimate([]) is None
    assert save_estimate([50.0, 1.0, 2.0, 3.0, 4.0, 5.0]) == 5.0  # 50 s is 6 saves ago
    assert save_estimate([1.0, 9.0, 2.0]) == 9.0


# -- parsers on recorded 22.05 output --------------------------------------------------------


def test_site_parsers_read_recorded_scontrol_output() -> None:
    config = parse_key_values((DATA / "scontrol_show_config.txt").read_text())
    assert config["KillWait"] == "5 sec" and config["PreemptType"] == "preempt/partition_prio"
    assert parse_duration_s(config["KillWait"]) == 5.0
    assert parse_duration_s("2 min") == 120.0 and parse_duration_s("UNLIMITED") is None
    parts = parse_partition((DATA / "scontrol_show_partition.txt").read_text())
    assert parts == [
        PartitionInfo("low", 20.0, "REQUEUE", True),
        PartitionInfo("high", 0.0, "OFF", False),
    ]
    low = window_from_site(config, parts, None, 120)  # None: the default partition
    assert low == NoticeWindow(120, 20.0, 5.0, "low", True)
    assert window_from_site(config, parts, "high", 120).preemptable is False


# -- the real local Slurm ----------------------------------------------------------------------


@pytest.mark.slurm
def test_the_live_local_slurm_gives_a_25_s_preemption_window_on_low(
    slurm_cluster: SlurmCluster,
) -> None:
    client = slurm_cluster.client
    window = window_from_site(client.site_config(), client.partitions("low"), "low", 120)
    assert (window.grace_time_s, window.kill_wait_s, window.preemptable) == (20.0, 5.0, True)
    verdict = plan_window(window, 60, save_s=30)
    assert [c.name for c in verdict.misfits] == ["preemption"]
    assert "GraceTime 20 s + KillWait 5 s (partition low)" in verdict.problems()[0]


@pytest.mark.slurm
def test_the_agent_check_reads_slurm_and_earlier_saves_and_warns_at_start(
    slurm_cluster: SlurmCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from slurm_elastic.agent.notice_window import check_notice_window

    events_dir = tmp_path / "events"
    monkeypatch.setenv(EVENTS_DIR_ENV, str(events_dir))
    # an earlier run of this task saved a checkpoint in 31 s: longer than 20 + 5 s
    events.emit(events.CheckpointSaved(step=10, path="/ckpt/10", seconds=31.0))
    config = load_config(
        None, environ={}, overrides={"events_dir": str(events_dir), "run_id": "w1"}
    )
    slurm = SlurmEnv.from_environ({"SLURM_JOB_ID": "7", "SLURM_JOB_PARTITION": "low"})
    with caplog.at_level(logging.INFO, logger="slurm_elastic.agent.notice_window"):
        verdict = check_notice_window(
            config, slurm, {SIGNAL_LEAD_ENV: "120"}, client=slurm_cluster.client
        )
    assert verdict.save_s == 31.0 and [c.name for c in verdict.misfits] == ["preemption"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "longer GraceTime on partition low" in warnings[0]
    (recorded,) = [e for e in events.read_events(events_dir) if isinstance(e, events.AgentWindow)]
    assert (recorded.grace_time_s, recorded.kill_wait_s, recorded.signal_lead_s) == (20, 5, 120)
    assert recorded.partition == "low" and recorded.fits is False


def test_outside_slurm_only_the_agent_budget_is_judged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slurm_elastic.agent.notice_window import check_notice_window

    monkeypatch.delenv(EVENTS_DIR_ENV, raising=False)
    config = load_config(None, environ={}, overrides={"events_dir": str(tmp_path / "none")})
    verdict = check_notice_window(config, SlurmEnv.from_environ({}), {SIGNAL_LEAD_ENV: "x"})
    assert [c.name for c in verdict.cases] == ["agent budget"]
    assert verdict.save_s is None
