"""The example job files in examples/configs/: each renders through ``slurm-elastic render``,
dry-runs through ``slurm-elastic submit --dry-run`` for Slurm and for local, and
local_demo.yaml actually completes as a local job (2 node agents x 2 gloo workers).
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_elastic.cli.main import main
from slurm_elastic.submit import JobState, plan_submission, submit, submit_from_config
from slurm_elastic.submit.render import render_template

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "examples" / "configs"
NAMES = ["fault_tolerant", "elastic_array", "elastic", "local_demo"]


def values(name: str) -> dict[str, Any]:
    data = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    assert isinstance(data, dict)
    return data


def test_every_shipped_config_is_tested() -> None:
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_config_renders_its_template_via_the_cli(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    mode = values(name)["mode"]
    assert main(["render", mode, "--config", str(CONFIGS / f"{name}.yaml")]) == 0
    script = capsys.readouterr().out
    assert script.startswith("#!/bin/bash\n")
    assert "${" not in re.sub(r"\$\{?[A-Z_]+\}?", "", script), "a placeholder was left"
    entrypoint = values(name)["entrypoint"]
    assert f"agent {entrypoint} " in script
    assert (REPO / entrypoint).is_file(), f"{name}: entrypoint {entrypoint} does not exist"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("fault_tolerant", ["#SBATCH --nodes=4", "SLURM_ELASTIC_NPROC_PER_NODE=8",
                            "SLURM_ELASTIC_MIN_NODES=4", "SLURM_ELASTIC_MAX_RESTARTS=3",
                            "examples/train_ddp.py"]),
        ("elastic", ["#SBATCH --nodes=1-4", "SLURM_ELASTIC_MIN_NODES=1",
                     "SLURM_ELASTIC_MAX_NODES=4", "srun "]),
        ("elastic_array", ["#SBATCH --array=0-3", "#SBATCH --nodes=1",
                           "SLURM_ELASTIC_MAX_NODES=4", "exec "]),
    ],
)  # fmt: skip
def test_cluster_configs_render_the_shape_they_describe(
    name: str, expected: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    main(["render", values(name)["mode"], "--config", str(CONFIGS / f"{name}.yaml")])
    script = capsys.readouterr().out
    for text in expected:
        assert text in script, f"{name}: {text!r} missing from\n{script}"
    assert "#SBATCH --signal=B:USR2@120" in script


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("cluster", ["slurm", "local"])
def test_config_dry_runs_through_submit(name: str, cluster: str) -> None:
    out = io.StringIO()
    assert submit_from_config(CONFIGS / f"{name}.yaml", cluster=cluster, dry_run=True, out=out) == 0
    text = out.getvalue()
    data = values(name)
    if cluster == "slurm":
        # one generator: the dry run is the rendered template
        assert text == render_template(data["mode"], data)
        nodes = data.get("nodes") or data.get("max_nodes") or int(str(data["nnodes"]).split(":")[1])
        if data["mode"] == "elastic_array":
            assert f"#SBATCH --array=0-{nodes - 1}" in text
        else:
            assert f"#SBATCH --nodes={nodes}" in text or "#SBATCH --nodes=1-" in text
    else:
        nodes = data.get("nodes") or data.get("max_nodes") or int(str(data["nnodes"]).split(":")[1])
        assert text.startswith(f"# local job: {nodes} agents ({data['mode']})")


def test_local_demo_plan_is_two_nodes_of_two_workers() -> None:
    plan = plan_submission(cluster="local", **values("local_demo"))
    assert (plan.request.min_nodes, plan.request.max_nodes) == (2, 2)
    assert plan.request.overrides["nproc_per_node"] == 2


@pytest.mark.timeout(240)
def test_local_demo_completes_as_a_local_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)  # the job file's paths are relative to the repository root
    job = submit(cluster="local", folder=tmp_path / "job", **values("local_demo"))
    with job:  # cancels (no process left behind) if the wait fails
        assert job.wait(timeout_s=180, poll_s=0.2) == JobState.COMPLETED
    assert job.exit_codes() == [0, 0]
    logs = "".join(p.read_text(errors="replace") for p in job.log_paths())
    assert "epoch 1 done: val top1" in logs, logs[-3000:]
    assert "world 4" in logs, "the two nodes trained as one world of 4"
    ckpts = (tmp_path / "job" / "state" / "checkpoints" / job.run_id).glob("step_*")
    assert max(int(p.name.split("_")[1]) for p in ckpts) == 16  # 2 epochs x 256 / 32
