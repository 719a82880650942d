"""Fault matrix, storage faults, on one single-task ``elastic_array`` job:

* a **stale rendezvous directory from an earlier job**: an earlier job of the same run id
  and rendezvous root is SIGKILLed whole (its open era, heartbeats and store record stay
  behind, as after a crash); the job of the matrix reuses that root and run id;
* **ENOSPC on the checkpoint directory**: the checkpoint directory is a small tmpfs
  (mounted by the test, as root); the test fills it while training runs, a save fails
  with a message naming the cause, nothing saved is lost, and once space is back the
  run goes on from the newest checkpoint and completes.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_elastic.checkpoint import CheckpointManager
from slurm_elastic.slurm.jobstate import JobState
from tests.conftest import SlurmCluster
from tests.faults.harness import FaultRun, Scenario
from tests.helpers import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(1200)]

RUN_ID = "faults-storage"
TERMINAL = {s for s in JobState if s.is_terminal}


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(directory: Path) -> Path:
    """Fill the filesystem of ``directory`` until ENOSPC; return the filler file."""
    filler = directory / ".filler"
    with open(filler, "wb") as fh:
        chunk = b"\0" * (1 << 16)
        with contextlib.suppress(OSError):
            while True:
                fh.write(chunk)
                fh.flush()
        with contextlib.suppress(OSError):
            os.fsync(fh.fileno())
    return filler


@pytest.fixture(scope="module")
def storage_run(
    slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Scenario]:
    if os.geteuid() != 0:
        pytest.skip(reason="mounting the small tmpfs for ENOSPC needs root")
    tmp = tmp_path_factory.mktemp("storage")
    sc = Scenario()
    rdzv = tmp / "shared-rdzv"
    common = {"nnodes": "1:1", "nproc_per_node": 1, "cpus_per_task": 1, "run_id": RUN_ID}
    earlier = FaultRun(
        slurm_cluster, tmp / "earlier", steps=3000, values={**common, "rdzv_endpoint": str(rdzv)}
    )
    with small_tmpfs(tmp / "ckpt", "6m") as ckpt:
        run = FaultRun(
            slurm_cluster,
            tmp / "run",
            steps=400,
            values={**common, "rdzv_endpoint": str(rdzv), "checkpoint_dir": str(ckpt)},
        )
        try:

            def stale_rendezvous_dir() -> None:
                earlier.submit()
                earlier.wait_training(1, 0, 240, "the earlier job")
                # a crash, not a cancel: Slurm's own KILL would let the agent leave cleanly
                for proc in [*earlier.workers(), *earlier.agents()]:
                    earlier.kill(proc)
                wait_for(
                    lambda: all(i.state in TERMINAL for i in earlier.infos()),
                    120,
                    "the earlier job to die",
                )
                assert list(rdzv.glob(f"{RUN_ID}/era.*/hb/*")), "no stale heartbeats left"
                t0 = time.time()
                run.submit()
                run.wait_training(1, t0, 240, "the job over the stale rendezvous directory")
                started = run.events(t0, "train.start")
                assert started[0]["step"] == 0, "it resumed the earlier job's checkpoints"

            def enospc_checkpoint_dir() -> None:
                wait_for(lambda: run.step_now() >= 30, 120, "a few checkpoints", interval=0.2)
                t0 = time.time()
                before = {c.step: c.path for c in CheckpointManager(ckpt).list_checkpoints()}
                filler = _fill(ckpt)
                try:
                    failed = wait_for(
                        lambda: run.events(t0, "checkpoint.failed"), 120, "a save to fail on ENOSPC"
                    )
                    assert (
                        "No space left" in failed[0]["error"] or "ENOSPC" in failed[0]["error"]
                    ), failed
                    # what was saved before is still there and verifies
                    manager = CheckpointManager(ckpt)
                    for step in before:
                        if (ckpt / f"step_{step}").exists():
                            manager.load(step)
                    assert manager.latest_verified() is not None
                finally:
                    filler.unlink()
                run.wait_training(1, time.time(), 240, "training after space came back")

            sc.run("stale_rendezvous_dir", stale_rendezvous_dir)
            sc.run("enospc_checkpoint_dir", enospc_checkpoint_dir)
            try:
                assert run.job, "the job of the matrix was never submitted"
                infos = run.finish()
                assert {i.state for i in infos} == {JobState.COMPLETED}, f"{infos}\n{run.logs()}"
                run.check_end(tmp)
            except Exception as exc:
                sc.end_error = f"{type(exc).__name__}: {exc}"
            yield sc
        finally:
            earlier.cleanup()
            run.cleanup()
            wait_for(
                lambda: all(i.state in TERMINAL for i in run.infos()) if run.job else True,
                60,
                "the run to be gone before unmounting",
            )


@pytest.mark.parametrize("case", ["stale_rendezvous_dir", "enospc_checkpoint_dir"])
def test_storage_fault(storage_run: Scenario, case: str) -> None:
    storage_run.check(case)
