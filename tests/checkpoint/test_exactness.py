"""Exact elastic resume over real gloo process groups (CPU, deterministic, tiny DDP model).

* same world size, interrupted and resumed (async saves on the way) → parameters bitwise
  equal to the uninterrupted run;
* resumed with other world sizes 4 → 2 → 3 under the fixed-global-batch policy → equal
  within ``RTOL``/``ATOL`` (float reassociation only, see docs/checkpoint.md), while the
  fixed-per-rank-batch policy (global batch changes) lands far outside that tolerance;
* sample ledger: every index consumed exactly once per epoch across 4 → 2 → 3.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slurm_elastic import ledger as sample_ledger

WORKER = Path(__file__).with_name("train_worker.py")
N_SAMPLES = 50  # = train_worker.N_SAMPLES; global batch 12 -> 5 steps per epoch (tail of 2)
TOTAL_STEPS = 15  # 3 epochs
# Tolerance for a run resumed at other world sizes vs. the uninterrupted one. Measured
# max abs difference ~1e-7 (a few float32 ulps of O(0.1..1) parameters); 20x margin.
ATOL = 2e-6
RTOL = 2e-6

NO_DROPOUT = ("--dropout", "0")

pytestmark = pytest.mark.slow


def launch(world: int, tmp: Path, ckpt: Path, ledger: Path, stop: int, *extra: str) -> Path:
    """Run ``world`` worker processes to ``stop``; return rank 0's final parameter file."""
    tag = f"w{world}-s{stop}-{len(list(tmp.glob('store-*')))}"
    store = tmp / f"store-{tag}"
    out = tmp / f"params-{tag}.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(world)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                "--init-file",
                str(store),
                "--ckpt",
                str(ckpt),
                "--ledger",
                str(ledger),
                "--stop-step",
                str(stop),
                "--out",
                str(out),
                *extra,
            ],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    outputs: list[str] = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:  # one rank failed or hung: do not leave the others waiting
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)
    for rank, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank}/{world} failed ({p.returncode}):\n{text}"
    return out


def params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("baseline")
    (tmp / "ledger").mkdir()
    return params(launch(2, tmp, tmp / "ckpt", tmp / "ledger", TOTAL_STEPS))


@pytest.fixture(scope="module")
def baseline_no_dropout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Across world sizes only a model without per-rank randomness can match: dropout masks
    come from per-rank RNG streams, and which rank sees which sample depends on the world
    size (see bundle.py)."""
    tmp = tmp_path_factory.mktemp("baseline_nd")
    (tmp / "ledger").mkdir()
    return params(launch(2, tmp, tmp / "ckpt", tmp / "ledger", TOTAL_STEPS, *NO_DROPOUT))


def test_same_world_size_resume_is_bitwise_exact(
    tmp_path: Path, baseline: dict[str, torch.Tensor]
) -> None:
    ckpt, ledger = tmp_path / "ckpt", tmp_path / "ledger"
    ledger.mkdir()
    launch(2, tmp_path, ckpt, ledger, 7)  # interrupted mid-epoch (after an async save at 4)
    resumed = params(launch(2, tmp_path, ckpt, ledger, TOTAL_STEPS))
    for name, value in baseline.items():
        assert torch.equal(resumed[name], value), f"{name} differs after resume"


def test_resize_4_2_3_consumes_each_sample_once_per_epoch_and_matches_within_tolerance(
    tmp_path: Path, baseline_no_dropout: dict[str, torch.Tensor]
) -> None:
    baseline = baseline_no_dropout
    ckpt, ledger = tmp_path / "ckpt", tmp_path / "ledger"
    ledger.mkdir()
    launch(4, tmp_path, ckpt, ledger, 3, *NO_DROPOUT)  # mid epoch 0
    launch(2, tmp_path, ckpt, ledger, 8, *NO_DROPOUT)  # into epoch 1, stops mid-epoch
    final = params(launch(3, tmp_path, ckpt, ledger, TOTAL_STEPS, *NO_DROPOUT))  # tail: 2,0

    # One file per rank and launch, no rank or attempt fields: whole epochs are judged.
    records = sample_ledger.read(*sorted(ledger.glob("*.jsonl")))
    problems = sample_ledger.check(records, N_SAMPLES, epochs=3, whole_steps=False)
    assert not problems, problems

    worst = max((final[k] - v).abs().max().item() for k, v in baseline.items())
    for name, value in baseline.items():
        torch.testing.assert_close(final[name], value, atol=ATOL, rtol=RTOL, msg=name)
    print(f"max abs difference after 4->2->3 resume: {worst:.3g}")


def test_changing_the_global_batch_is_detected_by_the_tolerance(
    tmp_path: Path, baseline_no_dropout: dict[str, torch.Tensor]
) -> None:
    baseline = baseline_no_dropout
    """Negative control: per-rank batch fixed (6), world 2 -> 3 makes the global batch 18;
    the result must land far outside ATOL, or the tolerance above would prove nothing."""
    ckpt, ledger = tmp_path / "ckpt", tmp_path / "ledger"
    ledger.mkdir()
    fixed_local = ("--mode", "fixed_local", *NO_DROPOUT)
    launch(2, tmp_path, ckpt, ledger, 7, *fixed_local)
    final = params(launch(3, tmp_path, ckpt, ledger, TOTAL_STEPS, *fixed_local))
    worst = max((final[k] - v).abs().max().item() for k, v in baseline.items())
    print(f"max abs difference with a changed global batch: {worst:.3g}")
    assert worst > 100 * ATOL
