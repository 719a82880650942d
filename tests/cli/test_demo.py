"""The README's demo (scripts/demo.sh -> scripts/demo.py) runs and ends with the status
table and the timeline picture of its own run: the user's first impression.

With the repository's ``.venv`` present (CI, scripts/test.sh) the test runs demo.sh itself,
which uses the running cluster and never stops a cluster it did not start; otherwise it
runs demo.py with this interpreter (demo.sh would first create the venv).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import SlurmCluster

REPO = Path(__file__).resolve().parent.parent.parent
DEMO_DIRS = r"slurm-elastic-demo-[\w-]+"  # scripts/demo.py's working directories, in /var/tmp


@pytest.fixture
def demo_dirs() -> Iterator[list[Path]]:
    """The demo keeps its working directory for the user (its status and timeline); a
    test's run of it removes it (each suite run left two behind). Only the directory its
    own demo printed: another test may be running a demo at the same time."""
    made: list[Path] = []
    yield made
    for work in made:
        shutil.rmtree(work, ignore_errors=True)


def _run_demo(cluster: str, env: dict[str, str], timeout: float, made: list[Path]) -> str:
    if cluster == "slurm" and (REPO / ".venv" / "bin" / "python").exists():
        argv = [str(REPO / "scripts" / "demo.sh")]
    else:
        argv = [sys.executable, str(REPO / "scripts" / "demo.py"), "--cluster", cluster]
    env = {**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    out = proc.stdout + proc.stderr
    work = re.search(
        r"working directory \(shared by all nodes\): (/var/tmp/" + DEMO_DIRS + ")$", out, re.M
    )
    if work is not None:
        made.append(Path(work.group(1)))
    assert proc.returncode == 0, out[-6000:]
    assert work is not None, out[-3000:]
    return proc.stdout


def _check_ending(out: str) -> None:
    assert "demo finished: OK" in out
    assert re.search(r"^run \S+   state COMPLETED", out, flags=re.M), out[-3000:]
    assert re.search(r"^NODE +HOST +SLURM JOB +STATE", out, flags=re.M)
    png = re.search(r"timeline of this run .*: (\S+\.png)$", out, flags=re.M)
    assert png is not None, out[-3000:]
    assert Path(png.group(1)).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_demo_without_slurm_runs_local_agents_and_shows_status_and_timeline(
    demo_dirs: list[Path],
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    out = _run_demo("local", env, timeout=600, made=demo_dirs)
    assert "no Slurm cluster here: running 3 local node agents" in out
    assert "world is now 2 node(s)" in out and "world is now 3 node(s)" in out
    assert re.search(r"^vm:\d+ .* preempted ", out, flags=re.M) or " preempted " in out
    _check_ending(out)


@pytest.mark.slow
@pytest.mark.slurm
def test_demo_on_slurm_preempts_requeues_and_shows_status_and_timeline(
    slurm_cluster: SlurmCluster, demo_dirs: list[Path]
) -> None:
    # KEEP_CLUSTER=1: demo.sh must never stop a cluster, even one it started itself
    env = {**os.environ, **slurm_cluster.env, "KEEP_CLUSTER": "1"}
    out = _run_demo("slurm", env, timeout=900, made=demo_dirs)
    assert "requeued its own task" in out
    assert re.search(r"^SLURM TASK +STATE", out, flags=re.M)
    assert "left in the queue: nothing" in out
    _check_ending(out)
    assert slurm_cluster.client.ping()  # the shared cluster is still up
