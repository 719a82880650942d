"""On the local Slurm cluster (netns mode: real per-node hostnames, IPs and ports)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from slurm_elastic.slurm.jobstate import JobState
from tests.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.netns]

SCRIPT = Path(__file__).with_name("scripts") / "slurm_node.py"


def test_srun_agents_on_four_nodes_form_one_world(
    slurm_netns_cluster: SlurmCluster, tmp_path: Path
) -> None:
    cluster = slurm_netns_cluster
    root, out = tmp_path / "rdzv", tmp_path / "out"
    out.mkdir()
    body = (
        "#!/bin/bash\nset -eu\nexport OMP_NUM_THREADS=1\n"
        f"srun --output='{tmp_path}/task.%t' {sys.executable} {SCRIPT} '{root}' '{out}'\n"
    )
    job = cluster.client.submit(
        body, ["-N4", "--ntasks-per-node=1", "-o", str(tmp_path / "job.out")]
    )
    info = cluster.wait_state(job, {s for s in JobState if s.is_terminal}, timeout=240)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted(tmp_path.glob("task.*")))
    assert info.state is JobState.COMPLETED, f"{info}\n{logs}"
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert len(records) == 4, logs
    assert sorted(r["rank"] for r in records) == [0, 1, 2, 3]
    assert {r["world"] for r in records} == {4}
    assert {r["sum"] for r in records} == {10.0}
    assert len({r["store"] for r in records}) == 1
    # The store is advertised under the Slurm node name of rank 0 (reachable from the
    # other nodes' network namespaces), and each task ran on its own node.
    rank0 = next(r for r in records if r["rank"] == 0)
    assert records[0]["store"].split(":")[0] == rank0["node"]
    assert sorted(r["hostname"] for r in records) == sorted(r["node"] for r in records)
