"""FSDP2 and HSDP in place, on real agents: ``examples/train_fsdp.py`` (a small transformer
under ``fully_shard``; ``--hsdp 2``: a ``(replicate, shard)`` mesh) through a join, a
graceful leave and a hard loss.

Join and leave re-shard in place: the survivors keep their PIDs, no step is redone, every
sample is used once per epoch and the final parameters match the uninterrupted one-process
run of the same math. A hard loss with HSDP is recovered in place from the surviving
replica (at most the step in flight redone); with plain FSDP2 the lost shards exist
nowhere else: the workers raise ``ShardsLostError`` and the agent restarts them from the
newest checkpoint (the restart path), so at most ``--save-every`` steps are redone.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
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

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SCRIPT = REPO / "examples" / "train_fsdp.py"
STEPS = 160
SAVE_EVERY = 10
HSDP = [pytest.param("1", id="fsdp"), pytest.param("2", id="hsdp2")]


def _node(
    tmp: Path,
    run_id: str,
    name: str,
    hsdp: str,
    agent_args: tuple[str, ...] = (),
    script_args: tuple[str, ...] = (),
) -> LiveRun:
    return LiveRun(
        tmp, run_id, "1:2", name, "--hsdp", hsdp, "--save-every", str(SAVE_EVERY), *script_args,
        "--pace-until-file", str(tmp / "release"),  # paced until the test's change is done
        steps=STEPS, step_time=0.1, script=SCRIPT, agent_args=agent_args,
    )  # fmt: skip


def _release_once(tmp: Path, what: str, held: Callable[[list[dict]], bool]) -> None:
    """Once the ledger shows ``what`` (``held(records)``), let the training run at full
    speed: the change under test is done, the rest only has to finish."""
    wait_for(lambda: held(ledger(tmp)), 150, what)
    (tmp / "release").touch()


def _world_of_4(tmp: Path) -> None:
    wait_for(
        lambda: (
            len({r["pid"] for r in ledger(tmp) if r["world"] == 4}) == 4 and steps_done(tmp) >= 15
        ),
        150,
        "a world of 4 training",
    )


def _assert_close_to_reference(tmp: Path) -> None:
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import train_fsdp
    finally:
        sys.path.pop(0)
    ref = train_fsdp.reference(
        ["--steps", str(STEPS), "--dataset-size", str(DATASET), "--global-batch", str(GLOBAL_BATCH)]
    )
    got = torch.load(tmp / "out.pt")
    assert set(got) == set(ref)
    for key, value in ref.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("hsdp", HSDP)
def test_fsdp_join_reshards_in_place(tmp_path: Path, nodes: list[LiveRun], hsdp: str) -> None:
    a = _node(tmp_path, f"fsdp-join-{hsdp}", "a", hsdp)
    nodes.append(a)
    wait_for(lambda: steps_done(tmp_path) >= 15, 120, "node a to train alone")
    a_pids = {r["pid"] for r in ledger(tmp_path)}
    b = _node(tmp_path, f"fsdp-join-{hsdp}", "b", hsdp)
    nodes.append(b)
    _release_once(tmp_path, "the grown world", lambda rs: any(r["world"] == 4 for r in rs))
    assert a.wait(240) == ExitCode.FINISHED, a.log()
    assert b.wait(60) == ExitCode.FINISHED, b.log()
    records = ledger(tmp_path)
    assert {r["world"] for r in records} == {2, 4}
    last = [r for r in records if r["step"] == STEPS]
    assert {r["pid"] for r in last} >= a_pids and {r["world"] for r in last} == {4}
    assert redone_steps(records) == 0
    assert_each_sample_once(records, STEPS)
    _assert_close_to_reference(tmp_path)


@pytest.mark.parametrize("hsdp", HSDP)
def test_fsdp_graceful_leave_reshards_in_place(
    tmp_path: Path, nodes: list[LiveRun], hsdp: str
) -> None:
    a = _node(tmp_path, f"fsdp-leave-{hsdp}", "a", hsdp)
    b = _node(tmp_path, f"fsdp-leave-{hsdp}", "b", hsdp)
    nodes += [a, b]
    _world_of_4(tmp_path)
    a_pids = a.worker_pids()
    b.signal(signal.SIGUSR2)
    assert b.wait(120) == ExitCode.PREEMPTED, b.log()
    _release_once(
        tmp_path, "the shrunk world", lambda rs: any(r["world"] == 2 and r["step"] > 15 for r in rs)
    )
    assert a.wait(180) == ExitCode.FINISHED, a.log()
    records = ledger(tmp_path)
    world2 = [r for r in records if r["world"] == 2 and r["step"] > 15]
    assert world2 and {r["pid"] for r in world2} == a_pids
    assert redone_steps(records) == 0
    assert_each_sample_once(records, STEPS)
    _assert_close_to_reference(tmp_path)


def _hard_loss(
    tmp: Path, nodes: list[LiveRun], run_id: str, hsdp: str, copy_every: str
) -> tuple[LiveRun, set[int], list[dict], int]:
    """Nodes a and b (2 workers each) train at world 4; b is SIGKILLed (agent and
    workers); a finishes alone. Checks what every hard loss must give (world 2 after the
    loss, each sample once per epoch, the parameters of the one-process run); returns a,
    its workers' PIDs before the loss, the ledger's records after it and the redone steps."""
    restarts = ("--max-restarts", "2")
    a = _node(tmp, run_id, "a", hsdp, restarts, ("--copy-every", copy_every))
    b = _node(tmp, run_id, "b", hsdp, restarts, ("--copy-every", copy_every))
    nodes += [a, b]
    _world_of_4(tmp)
    a_pids = a.worker_pids()
    killed_at = steps_done(tmp)
    b.kill_node()
    _release_once(
        tmp,
        "training on after the loss",
        lambda rs: any(r["world"] == 2 and r["step"] > killed_at + 1 for r in rs),
    )
    assert a.wait(240) == ExitCode.FINISHED, a.log()
    records = ledger(tmp)
    after = [r for r in records if r["step"] > killed_at + 1]
    assert after and {r["world"] for r in after} == {2}
    assert_each_sample_once(records, STEPS)
    _assert_close_to_reference(tmp)
    return a, a_pids, after, redone_steps(records)


def test_hsdp_hard_loss_rebuilds_the_lost_replica_in_place(
    tmp_path: Path, nodes: list[LiveRun]
) -> None:
    """With ``--hsdp 2`` each node holds one whole replica (its 2 ranks shard it): when
    node b is SIGKILLed, node a's workers rebuild the state from their own shards
    (live/shards.py) and train on at world 2 in the same processes; at most the step in
    flight is redone, no checkpoint is read."""
    a, a_pids, after, redone = _hard_loss(tmp_path, nodes, "hsdp-hard", "2", "0")
    assert {r["pid"] for r in after} == a_pids, "the survivors' workers were restarted"
    assert "ShardsLostError" not in a.log()
    assert redone <= 1


def test_fsdp_hard_loss_rebuilds_from_the_neighbours_copies_in_place(
    tmp_path: Path, nodes: list[LiveRun]
) -> None:
    """Plain FSDP2 keeps each shard on one rank; with ``--copy-every 4`` every rank also
    holds its neighbour's shards (the same local rank of the other node) of every 4th
    step. Node b is SIGKILLed: node a's workers rebuild the newest copied step from their
    own copies and b's and train on at world 2 in the same processes, redoing at most 4
    steps plus the one in flight."""
    a, a_pids, after, redone = _hard_loss(tmp_path, nodes, "fsdp-hard", "1", "4")
    assert {r["pid"] for r in after} == a_pids, "the survivors' workers were restarted"
    assert "ShardsLostError" not in a.log()
    assert redone <= 4 + 1


def test_fsdp_hard_loss_without_copies_restarts_from_checkpoint(
    tmp_path: Path, nodes: list[LiveRun]
) -> None:
    """Plain FSDP2 without neighbour copies (``--copy-every 0``): node b's shards are
    gone with it, the survivors' workers stop with ShardsLostError, the agent restarts
    them and they resume from the newest checkpoint (at most ``--save-every`` steps
    redone)."""
    a, a_pids, after, redone = _hard_loss(tmp_path, nodes, "fsdp-hard0", "1", "0")
    if {r["pid"] for r in after} != a_pids:  # restarted (else: lost right after a
        # checkpoint's gather, before the next optimizer step: recovered in place)
        assert not {r["pid"] for r in after} & a_pids and "ShardsLostError" in a.log()
    assert redone <= SAVE_EVERY + 1


@pytest.mark.parametrize("hsdp", HSDP)
def test_fsdp_without_membership_change_in_place_equals_the_restart_path_bitwise(
    tmp_path: Path, nodes: list[LiveRun], hsdp: str
) -> None:
    # One node, 2 workers sharding the model: the in-place machinery (its store, the
    # step-boundary agreement, the commits) must not change one bit of the math.
    outs = []
    for mode in ("1", "0"):  # SLURM_ELASTIC_IN_PLACE: in place, then the restart path
        tmp = tmp_path / f"in_place_{mode}"
        tmp.mkdir()
        run = LiveRun(
            tmp, f"fbit{mode}", "1", "a", "--hsdp", hsdp, "--save-every", str(SAVE_EVERY),
            steps=40, step_time=0.0, script=SCRIPT, env={"SLURM_ELASTIC_IN_PLACE": mode},
        )  # fmt: skip
        nodes.append(run)
        assert run.wait(180) == ExitCode.FINISHED, run.log()
        outs.append(torch.load(tmp / "out.pt"))
    assert outs[0].keys() == outs[1].keys() and outs[0]
    unequal = [k for k in outs[0] if not torch.equal(outs[0][k], outs[1][k])]
    assert not unequal, f"parameters differ between in place and the restart path: {unequal}"
