"""status, logs and timeline on a real local Slurm run: an elastic_array job of 2 tasks
(2 nodes) trains examples/train_ddp.py; the verbs find it by its array job id."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from slurm_elastic.cli.main import main
from slurm_elastic.submit import JobState, submit
from tests.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent.parent


def test_status_logs_timeline_of_a_slurm_array_run_by_job_id(
    slurm_cluster: SlurmCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = submit(
        str(REPO / "examples" / "train_ddp.py"),
        [
            "--steps",
            "40",
            "--step-time",
            "0.05",
            "--save-every",
            "20",
            "--dataset-size",
            "160",
            "--global-batch",
            "8",
        ],
        cluster="slurm",
        client=slurm_cluster.client,
        python=sys.executable,  # the agents' launcher: this venv, whatever PATH says
        mode="elastic_array",
        nnodes="2:2",
        nproc_per_node=1,
        output_dir=str(tmp_path / "logs"),
        state_dir=str(tmp_path / "state"),
        # The job's environment is the Slurm client's (sbatch's), not this test's: the
        # per-test run index (tests/cli/conftest.py) is handed to the agents explicitly.
        env={"OMP_NUM_THREADS": "1", "XDG_STATE_HOME": os.environ["XDG_STATE_HOME"]},
        exclusive=True,
        last_call_timeout_s=2,
        join_timeout_s=240,
        heartbeat_interval_s=0.5,
    )
    try:
        state = job.wait(timeout_s=400, poll_s=1)
    finally:
        if not job.done():
            job.cancel()
    assert state == JobState.COMPLETED
    capsys.readouterr()

    assert main(["status", job.job_id]) == 0
    table = capsys.readouterr().out
    assert re.search(rf"^{job.job_id}_0 +node\d +{job.job_id}_0 +finished ", table, flags=re.M), (
        table
    )
    assert re.search(rf"^{job.job_id}_1 +node\d +{job.job_id}_1 +finished ", table, flags=re.M), (
        table
    )
    assert re.search(rf"^{job.job_id}_0 +COMPLETED +node\d", table, flags=re.M), table

    assert main(["status", f"{job.job_id}_1", "--json"]) == 0  # a task id names its array
    doc = json.loads(capsys.readouterr().out)
    assert (doc["run_id"], doc["state"]) == (job.job_id, "COMPLETED")
    assert doc["world"] == {"nodes": 2, "workers": 2} and doc["progress"]["step"] == 40
    assert [n["node"] for n in doc["nodes"]] == [f"{job.job_id}_0", f"{job.job_id}_1"]
    assert doc["slurm"]["job"] == job.job_id and doc["slurm"]["error"] is None
    assert {t["ref"]: t["state"] for t in doc["slurm"]["tasks"]}[f"{job.job_id}_0"] == "COMPLETED"
    hosts = {n["host"] for n in doc["nodes"]}
    assert len(hosts) == 2 and all(h.startswith("node") for h in hosts)
    # the agents read the warning their tasks get: partition low's GraceTime 20 s and
    # KillWait 5 s (scripts/slurm-cluster), submit's --signal lead (120 s)
    window = doc["preemption_window"]
    assert {w["case"]: w["seconds"] for w in window["windows"]} == {
        "preemption": 25,
        "time limit": 125,
        "agent budget": 60,
    }, window
    assert window["fits"] is True and window["problems"] == [], window

    assert main(["logs", job.job_id, "--rank", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(re.match(rf"^\[{job.job_id}_\d rank 0 #1\] step 40 loss", line) for line in lines), (
        lines
    )

    png = tmp_path / "t.png"
    assert main(["timeline", job.job_id, "-o", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
