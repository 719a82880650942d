"""``notice.preemption_agreed``: one rank's notice becomes every rank's decision (real gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import os, sys
import torch.distributed as dist
from slurm_elastic import notice
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=3)
print(notice.preemption_agreed())
dist.destroy_process_group()
"""


def test_a_notice_on_one_node_is_agreed_by_every_rank(tmp_path: Path) -> None:
    notice_file = tmp_path / "notice"
    notice_file.write_text("preempt\n")
    procs = []
    for rank in range(3):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("SLURM_ELASTIC_NOTICE_FILE", None)
        if rank == 1:  # only rank 1's node was told to stop
            env["SLURM_ELASTIC_NOTICE_FILE"] = str(notice_file)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", CHILD, str(rank), str(tmp_path / "store")],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert outputs == ["(True, False)", "(True, True)", "(True, False)"]


def test_without_notice_nobody_stops(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SLURM_ELASTIC_NOTICE_FILE"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(r), str(tmp_path / "s")],
            env={**env, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(3)
    ]
    assert [p.communicate(timeout=120)[0].strip() for p in procs] == ["(False, False)"] * 3
