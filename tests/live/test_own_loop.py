"""Keep your own loop (``ElasticSession``), in place, on real agents: join, graceful leave,
hard loss with ``examples/train_own_loop.py`` (a ``DataLoader`` with a worker process, a
``GradScaler``, two optimizers, an LR scheduler and an EMA model).

Each test asserts what the ``ElasticLoop`` tests assert (survivors keep their PIDs, no step
lost or only the rolled-back one redone, every sample once per epoch) and that the final
parameters, the EMA and the scaler's scale match the uninterrupted run of the same script.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import torch

from slurm_elastic.agent import ExitCode
from tests.helpers import wait_for
from tests.live.conftest import (
    DATASET,
    GLOBAL_BATCH,
    REPO,
    LiveRun,
    assert_each_sample_once,
    ledger,
    redone_steps,
    steps_done,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

SCRIPT = REPO / "examples" / "train_own_loop.py"
STEPS = 240


def _node(tmp: Path, run_id: str, name: str) -> LiveRun:
    return LiveRun(tmp, run_id, "1:2", name, steps=STEPS, script=SCRIPT)


def _world_of_4(tmp: Path) -> None:
    wait_for(
        lambda: (
            len({r["pid"] for r in ledger(tmp) if r["world"] == 4}) == 4 and steps_done(tmp) >= 20
        ),
        120,
        "a world of 4 training",
    )


def _assert_close_to_reference(tmp: Path) -> None:
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import train_own_loop
    finally:
        sys.path.pop(0)
    ref = train_own_loop.reference(
        ["--steps", str(STEPS), "--dataset-size", str(DATASET), "--global-batch", str(GLOBAL_BATCH)]
    )
    got = torch.load(tmp / "out.pt")
    assert set(got) == set(ref)
    assert any(k.startswith("ema.") for k in got) and float(got["scaler.scale"]) > 1024.0
    for key, value in ref.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_own_loop_join_in_place(tmp_path: Path, nodes: list[LiveRun]) -> None:
    a = _node(tmp_path, "own-join", "a")
    nodes.append(a)
    wait_for(lambda: steps_done(tmp_path) >= 15, 90, "node a to train alone")
    a_pids = {r["pid"] for r in ledger(tmp_path)}
    b = _node(tmp_path, "own-join", "b")
    nodes.append(b)
    assert a.wait(180) == ExitCode.FINISHED, a.log()
    assert b.wait(60) == ExitCode.FINISHED, b.log()
    records = ledger(tmp_path)
    assert {r["world"] for r in records} == {2, 4}
    last = [r for r in records if r["step"] == STEPS]
    assert {r["pid"] for r in last} >= a_pids and {r["world"] for r in last} == {4}
    assert redone_steps(records) == 0
    assert_each_sample_once(records, STEPS)
    _assert_close_to_reference(tmp_path)


def test_own_loop_graceful_leave_in_place(tmp_path: Path, nodes: list[LiveRun]) -> None:
    a, b = _node(tmp_path, "own-leave", "a"), _node(tmp_path, "own-leave", "b")
    nodes += [a, b]
    _world_of_4(tmp_path)
    a_pids = a.worker_pids()
    b.signal(signal.SIGUSR2)
    assert b.wait(90) == ExitCode.PREEMPTED, b.log()
    assert a.wait(120) == ExitCode.FINISHED, a.log()
    records = ledger(tmp_path)
    world2 = [r for r in records if r["world"] == 2 and r["step"] > 20]
    assert world2 and {r["pid"] for r in world2} == a_pids
    assert redone_steps(records) == 0
    assert_each_sample_once(records, STEPS)
    _assert_close_to_reference(tmp_path)


def test_own_loop_hard_loss_in_place(tmp_path: Path, nodes: list[LiveRun]) -> None:
    a, b = _node(tmp_path, "own-hard", "a"), _node(tmp_path, "own-hard", "b")
    nodes += [a, b]
    _world_of_4(tmp_path)
    a_pids = a.worker_pids()
    killed_at = steps_done(tmp_path)
    b.kill_node()
    assert a.wait(150) == ExitCode.FINISHED, a.log()
    records = ledger(tmp_path)
    after = [r for r in records if r["step"] > killed_at + 2]
    assert after and {r["pid"] for r in after} == a_pids and {r["world"] for r in after} == {2}
    assert redone_steps(records) <= 2
    assert_each_sample_once(records, STEPS)
    _assert_close_to_reference(tmp_path)
