"""Unit tests of the live parts: node channel, state commit/restore, failure
classification, the agent's monotonic hang watchdog and its use of torch's loop."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from slurm_elastic.agent.watchdog import ProgressWatch
from slurm_elastic.channel import NodeChannel
from slurm_elastic.live import ElasticState, is_peer_failure, roster
from slurm_elastic.notice import report_progress


def assignment(round_: int, local_rank: int = 0) -> roster.Assignment:
    return roster.Assignment(round_, 2, 4, local_rank, 1, 2, "127.0.0.1", 1234)


def test_assignment_watch_returns_only_newer_rounds(tmp_path: Path) -> None:
    watch = roster.AssignmentWatch(NodeChannel(tmp_path), 0, current_round=3, min_interval_s=0)
    assert watch.poll() is None
    roster.write_assignment(NodeChannel(tmp_path), assignment(3))
    assert watch.poll() is None  # the round the worker is in: stale
    roster.write_assignment(NodeChannel(tmp_path), assignment(4))
    assert watch.poll() == assignment(4)
    watch.current_round = 4
    assert watch.poll() is None


def test_malformed_assignment_is_ignored_with_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "assign.0").write_text('{"round": 5, "rank": 9, "world_size": 2}')
    assert roster.read_assignment(NodeChannel(tmp_path), 0) is None
    with pytest.raises(ValueError, match="malformed assignment"):
        roster.Assignment.from_dict({"round": "x"})


def test_registration_round_trip_and_clear(tmp_path: Path) -> None:
    roster.register_worker(NodeChannel(tmp_path), 0, 111)
    roster.register_worker(NodeChannel(tmp_path), 1, 222)
    assert roster.registered_workers(NodeChannel(tmp_path)) == {0: 111, 1: 222}
    NodeChannel(tmp_path).clear()
    assert roster.registered_workers(NodeChannel(tmp_path)) == {}


def test_in_place_switch() -> None:
    assert roster.in_place_enabled({})
    assert not roster.in_place_enabled({roster.IN_PLACE_ENV: "0"})


def test_restore_rolls_back_and_commit_is_not_aliased_by_the_optimizer() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step() -> None:
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()

    step()
    state = ElasticState(model, opt, step=1)
    state.commit((0, 1))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = opt.state[model.weight]["momentum_buffer"].clone()
    ptr = model.weight.data_ptr()
    for _ in range(2):  # twice: a restored optimizer must not write into the commit
        step()
        step()
        state.progress["step"] = 3
        state.restore()
        assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
        assert torch.equal(opt.state[model.weight]["momentum_buffer"], momentum)
        assert state.progress["step"] == 1
    assert model.weight.data_ptr() == ptr  # same Parameter storage: optimizer stays valid


def test_peer_failures_are_told_from_bugs_by_type() -> None:
    # real killed peers and timeouts: tests/live/test_peer_failure.py
    assert is_peer_failure(torch.distributed.DistNetworkError("x"))
    assert is_peer_failure(torch.distributed.DistStoreError("x"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(ValueError("Connection reset"))
    # no gloo group here: the words of a gloo error do not make one a peer failure
    assert not is_peer_failure(RuntimeError("[gloo] Connection reset by peer"))


def test_watchdog_ignores_a_wall_clock_step(tmp_path: Path) -> None:
    # Issue 9 item 5: the old watchdog computed time.time() - <time in the file>; a
    # +100 s clock step made healthy workers look hung. Progress written with a wall time
    # 100 s in the past (what a step of the agent's clock looks like) must read as fresh.
    path = tmp_path / "progress"
    now = [1000.0]
    watch = ProgressWatch(path, clock=lambda: now[0])
    assert watch.age_s() == 0.0  # not armed before the first report
    path.write_text(f"{1:20d} {os.path.getmtime(tmp_path) - 100:20.6f}\n")
    assert watch.age_s() == 0.0
    now[0] += 2.0
    path.write_text(f"{2:20d} {os.path.getmtime(tmp_path) - 100:20.6f}\n")
    assert watch.age_s() == 0.0  # changed: progress
    now[0] += 5.0
    assert watch.age_s() == pytest.approx(5.0)  # unchanged for 5 s of monotonic time
    watch.reset()
    assert watch.age_s() == 0.0


def test_watchdog_sees_real_reports(tmp_path: Path) -> None:
    path = tmp_path / "progress"
    now = [0.0]
    watch = ProgressWatch(path, clock=lambda: now[0])
    report_progress(1, path=path, force=True)
    watch.age_s()
    now[0] = 10.0
    assert watch.age_s() == pytest.approx(10.0)
    report_progress(2, path=path, force=True)
    assert watch.age_s() == 0.0


def test_agent_uses_torchs_monitor_loop() -> None:
    # Issue 8 item 5: extension points, not a copy of _invoke_run (which dropped metrics).
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    from slurm_elastic.agent.elastic_agent import SlurmElasticAgent

    assert SlurmElasticAgent._invoke_run is SimpleElasticAgent._invoke_run
    assert "_monitor_workers" in SlurmElasticAgent.__dict__
    assert "_restart_workers" in SlurmElasticAgent.__dict__


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared-batchnorm"])
def test_background_commit_is_the_state_at_commit_time_although_the_optimizer_steps_at_once(
    monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    # A slow copy (every copy job of the host stager sleeps) makes the race certain:
    # without the stager's guards (the optimizer's step pre-hook, the forward pre-hook),
    # the next step would change parameters and statistics mid-copy.
    from slurm_elastic.checkpoint.staging import StagingRound

    real_copy = StagingRound._copy

    def slow_copy(self: StagingRound, job: object, touched: bool) -> None:
        time.sleep(0.02)
        real_copy(self, job, touched)  # type: ignore[arg-type]

    monkeypatch.setattr(StagingRound, "_copy", slow_copy)
    torch.manual_seed(0)
    norm = torch.nn.BatchNorm1d(256)
    # shared: the same BatchNorm used twice in a forward; its statistics appear under two
    # names in state_dict() (once in named_buffers()), and both must be the commit's
    layers = [torch.nn.Linear(256, 256), norm] + ([norm] if shared else [])
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(8, 256)).square().sum().backward()
        opt.step()

    step()
    state = ElasticState(model, opt, step=1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}  # buffers too
    momentum = opt.state[model[0].weight]["momentum_buffer"].clone()
    for _ in range(3):
        state.commit((0, 1), background=True)
        step()  # at once: the step pre-hook must wait for the copy
        step()
        state.restore()
        assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
        assert torch.equal(opt.state[model[0].weight]["momentum_buffer"], momentum)


def test_a_background_commit_changed_outside_step_and_forward_is_refused_not_torn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before (its own copy thread): a parameter changed in place by other means while the
    copy ran gave a commit that mixed two states, restored and sent without a word. Now the
    checkpoints' stager copies it and its version check refuses the commit, naming it."""
    from slurm_elastic.checkpoint.staging import StagingRound
    from slurm_elastic.errors import StagingConflict

    release = threading.Event()
    real_copy = StagingRound._copy

    def held_copy(self: StagingRound, job: object, touched: bool) -> None:
        release.wait(30)  # the copy starts only once the in-place change is done
        real_copy(self, job, touched)  # type: ignore[arg-type]

    monkeypatch.setattr(StagingRound, "_copy", held_copy)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ElasticState(model, opt, step=1)
    state.commit((0, 1), background=True)
    with torch.no_grad():
        model.weight.add_(1.0)  # neither optimizer.step() nor a forward pass
    release.set()
    with pytest.raises(StagingConflict, match=r"weight.*ElasticState.wait\(\)"):
        state.wait()
    assert not state.committed
    with pytest.raises(RuntimeError, match="before any commit"):
        state.restore()
