"""Plain ``torchrun --rdzv-backend=slurm``: the entry point, formation, one member loss."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.rendezvous.test_agents import SCRIPTS, Agents

pytestmark = pytest.mark.slow

TORCHRUN = Path(sys.executable).with_name("torchrun")


class TorchrunAgents(Agents):
    def start(self, run_id: str, min_n: int, max_n: int) -> subprocess.Popen[bytes]:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        log = open(self.out / f"agent{len(self.procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [
                str(TORCHRUN),
                f"--nnodes={min_n}:{max_n}",
                "--nproc-per-node=2",
                "--rdzv-backend=slurm",
                f"--rdzv-endpoint={self.root}",
                f"--rdzv-id={run_id}",
                "--rdzv-conf=heartbeat_interval=0.5,heartbeat_miss_limit=4,last_call_timeout=1",
                "--local-addr=127.0.0.1",
                "--max-restarts=3",
                "--monitor-interval=0.1",
                f"--log-dir={self.out / 'torch-logs'}",  # not a torchelastic_* dir in /tmp
                str(SCRIPTS / "worker.py"),
                str(self.out),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.procs.append(proc)
        return proc


@pytest.fixture
def torchrun(tmp_path: Path) -> Iterator[TorchrunAgents]:
    a = TorchrunAgents(tmp_path)
    yield a
    a.cleanup()


def test_torchrun_forms_a_world_and_survives_losing_a_member(torchrun: TorchrunAgents) -> None:
    assert TORCHRUN.exists()
    procs = [torchrun.start("job42", 1, 2) for _ in range(2)]
    first = wait_for(lambda: torchrun.world_reached(4), 120, "a world of 4 workers")
    victim = next(r["agent_pid"] for r in first if r["group_rank"] == 1)
    torchrun.kill_node(victim)
    second = wait_for(
        lambda: torchrun.world_reached(2, exclude_masters={first[0]["master"]}),
        120,
        "the surviving torchrun to continue with 2 workers",
    )
    assert victim not in {r["agent_pid"] for r in second}
    torchrun.stop_and_wait([p for p in procs if p.pid != victim])
