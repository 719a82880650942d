"""status, logs, timeline and ``submit --wait`` progress on a real local run: 2 node agents
(real processes, gloo, the shared-directory rendezvous) train examples/train_ddp.py."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest

from slurm_elastic.cli.main import main

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent.parent


def test_submit_wait_shows_progress_then_status_logs_timeline_find_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the job's folder is a new temporary directory, kept for the user: here in tmp_path
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    config = tmp_path / "job.yaml"
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                "mode": "elastic_array",
                "entrypoint": str(REPO / "examples" / "train_ddp.py"),
                "args": [
                    "--steps",
                    "60",
                    "--step-time",
                    "0.05",
                    "--save-every",
                    "20",
                    "--dataset-size",
                    "200",
                    "--global-batch",
                    "8",
                ],
                "nnodes": "2:2",
                "nproc_per_node": 1,
                "heartbeat_interval_s": 0.5,
                "last_call_timeout_s": 1,
                "monitor_interval_s": 0.2,
                "env": {"OMP_NUM_THREADS": "1"},
            }
        )
    )
    assert main(["submit", str(config), "--cluster", "local", "--wait"]) == 0
    out = capsys.readouterr().out
    run_id = re.search(r"submitted local job (local-\w+)", out).group(1)  # type: ignore[union-attr]
    assert f"job {run_id} COMPLETED" in out
    progress = [line for line in out.splitlines() if "world" in line and "RUNNING" in line]
    assert any("world 2 node(s)/2 worker(s)" in line for line in progress), out
    assert any(re.search(r"\[[#.]+\]\s+\d+% step \d+/60", line) for line in progress), out

    assert main(["status", run_id, "--json"]) == 0  # found through the run index
    doc = json.loads(capsys.readouterr().out)
    assert (doc["run_id"], doc["state"], doc["world"]) == (
        run_id,
        "COMPLETED",
        {"nodes": 2, "workers": 2},
    )
    assert doc["progress"]["step"] == 60 and doc["progress"]["fraction"] == 1.0
    assert doc["checkpoint"]["step"] == 60
    assert sorted(n["state"] for n in doc["nodes"]) == ["finished", "finished"]
    assert doc["throughput"]["steps_per_s"] > 0

    assert main(["status", "--json"]) == 0  # no job: the runs its agents recorded
    listed = json.loads(capsys.readouterr().out)["runs"]
    assert [(r["run_id"], r["state"], r["world_nodes"], r["step"]) for r in listed] == [
        (run_id, "COMPLETED", 2, 60)
    ]

    assert main(["logs", run_id, "--rank", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(re.match(r"^\[\S+ rank 0 #1\] step 60 loss", line) for line in lines), lines

    png = tmp_path / "timeline.png"
    assert main(["timeline", run_id, "-o", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_status_while_running_then_watch_until_the_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from slurm_elastic.events import read_events
    from slurm_elastic.submit import submit
    from tests.helpers import wait_for

    job = submit(
        str(REPO / "examples" / "train_ddp.py"),
        [
            "--steps",
            "150",
            "--step-time",
            "0.05",
            "--save-every",
            "50",
            "--dataset-size",
            "200",
            "--global-batch",
            "8",
        ],
        mode="elastic_array",
        cluster="local",
        folder=tmp_path / "job",
        nnodes="2:2",
        nproc_per_node=1,
        heartbeat_interval_s=0.5,
        last_call_timeout_s=1,
        env={"OMP_NUM_THREADS": "1"},
    )
    with job:
        events_dir = tmp_path / "job" / "state" / "events" / job.job_id
        wait_for(
            lambda: any(e.kind == "train.progress" for e in read_events(events_dir)),
            120,
            "training progress",
            interval=0.2,
        )
        assert main(["status", str(tmp_path / "job"), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["state"] == "RUNNING" and doc["ended"] is None
        assert doc["world"] == {"nodes": 2, "workers": 2}
        assert [n["state"] for n in doc["nodes"]] == ["training", "training"]
        assert 0 < doc["progress"]["step"] < 150 and doc["progress"]["total_steps"] == 150
        # --watch redraws until the run ends, then returns
        assert main(["status", job.job_id, "--watch", "--interval", "1"]) == 0
        frames = capsys.readouterr().out.split("\nrun ")
        assert len(frames) >= 2
        assert "RUNNING" in frames[0] and "state COMPLETED" in frames[-1]
        assert re.search(
            r"\d+s +RUNNING +world 2 node\(s\)/2 worker\(s\) +\[[#.]+\] +\d+% step", frames[0]
        )
