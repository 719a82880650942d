"""Sharded checkpoints via torch.distributed.checkpoint: saved by 2 ranks, loaded by 3
(real gloo process groups, DTensor sharded by rows), committed with our manifest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_elastic.checkpoint.manifest import verify_checkpoint

WORKER = Path(__file__).with_name("sharded_worker.py")


def run(mode: str, world: int, tmp: Path, ckpt: Path, *, check: bool = True) -> list[str]:
    store = tmp / f"store-{mode}-{world}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), mode, str(store), str(ckpt)],
            env={**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(r), "WORLD_SIZE": str(world)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outs: list[str] = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 or not check, f"{mode} rank {r}/{world} failed:\n{out}"
    return outs


@pytest.mark.slow
def test_sharded_checkpoint_saved_by_2_ranks_reshards_onto_3(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run("save", 2, tmp_path, ckpt)
    manifest = verify_checkpoint(ckpt / "step_5")
    assert manifest.kind == "sharded" and manifest.world_size == 2
    assert ".metadata" in {f.name for f in manifest.files}
    assert not list(ckpt.glob(".tmp-*"))
    outs = run("load", 3, tmp_path, ckpt)
    assert any("rank 2/3 holds rows 4" in o for o in outs), outs


@pytest.mark.slow
def test_sharded_enospc_raises_our_write_error_on_every_rank_and_cleans_up(
    small_fs: Path, tmp_path: Path
) -> None:
    """Issue #10.3: DCP raises CheckpointException (a BaseException) on ENOSPC."""
    outs = run("enospc", 2, tmp_path, small_fs / "ckpt")
    for rank, out in enumerate(outs):
        assert f"rank {rank} WRITE_ERROR" in out and "no space left" in out, out
        assert "keep_last" not in out


@pytest.mark.slow
def test_a_write_that_fails_on_one_rank_commits_nothing_and_every_rank_raises(
    tmp_path: Path,
) -> None:
    """Before one choreography: rank 0 committed as soon as its own write succeeded, so
    a failure on another rank left a committed checkpoint without that rank's shards."""
    outs = run("one_fails", 2, tmp_path, tmp_path / "ckpt")
    for rank, out in enumerate(outs):
        assert f"rank {rank} WRITE_ERROR rank 1: injected write failure" in out, out
