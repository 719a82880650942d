"""Dry runs of slurm_elastic.submit: the exact sbatch text, without Slurm.

One generator: the Slurm text is the rendered sbatch template, byte for byte what
``slurm-elastic render`` prints for the same values and what a submission sends
(``tests/submit/test_slurm_real.py`` checks what reaches Slurm). Golden files in
tests/data/golden/submit_*.sbatch (regenerate: UPDATE_GOLDEN=1).
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest

from slurm_elastic.errors import ConfigError
from slurm_elastic.submit import build_request, plan_submission, resolve_cluster, submit_from_config
from slurm_elastic.submit.render import render_template, slurm_time_minutes

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "golden"

COMMON = {"output_dir": "/shared/logs", "cluster": "slurm"}


def _check_golden(name: str, text: str) -> None:
    golden = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert text == golden.read_text()


def _directives(text: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", text, flags=re.M))


def test_array_dry_run_is_the_rendered_template_one_single_node_task_per_node() -> None:
    plan = plan_submission(
        "train.py", ["--epochs", "3"], nnodes="1:4", partition="low", time="02:00:00", **COMMON
    )
    assert plan.cluster == "slurm"
    _check_golden("submit_elastic_array.sbatch", plan.text)
    values = {"entrypoint": "train.py", "args": ["--epochs", "3"], "nnodes": "1:4"}
    values.update(partition="low", time="02:00:00", output_dir="/shared/logs")
    assert plan.text == render_template("elastic_array", values)
    d = _directives(plan.text)
    assert d["array"] == "0-3"
    assert (d["nodes"], d["ntasks-per-node"]) == ("1", "1")
    assert d["signal"] == "B:USR2@120"  # to the batch shell, which hands it to the agent
    assert d["open-mode"] == "append"
    assert "requeue" in d
    assert d["time"] == "02:00:00"
    assert d["output"] == "/shared/logs/%x-%A_%a.out"
    assert "env --block-signal=USR2" in plan.text  # the early-notice handling
    assert plan.text.rstrip().endswith("exec slurm-elastic agent train.py --epochs 3")
    assert "submitit" not in plan.text and "pickle" not in plan.text


def test_elastic_dry_run_is_one_job_with_node_range_and_srun_per_node() -> None:
    plan = plan_submission("train.py", mode="elastic", nnodes="2:4", **COMMON)
    _check_golden("submit_elastic.sbatch", plan.text)
    d = _directives(plan.text)
    assert d["nodes"] == "2-4"
    assert "array" not in d
    srun = next(line for line in plan.text.splitlines() if line.lstrip().startswith("srun "))
    assert "--kill-on-bad-exit=0" in srun
    assert "%j" in d["output"]


def test_fault_tolerant_dry_run_fixed_nodes() -> None:
    plan = plan_submission("train.py", mode="fault_tolerant", nodes=3, **COMMON)
    d = _directives(plan.text)
    assert d["nodes"] == "3"
    assert plan.request.overrides["min_nodes"] == plan.request.overrides["max_nodes"] == 3
    assert plan.request.overrides["nproc_per_node"] == 8  # the mode's default


def test_preempt_signal_is_consistent_between_slurm_and_agent() -> None:
    plan = plan_submission(
        "train.py", preempt_signal="SIGUSR1", signal_lead_s=300, nnodes="1:2", **COMMON
    )
    assert _directives(plan.text)["signal"] == "B:USR1@300"
    assert "export SLURM_ELASTIC_PREEMPT_SIGNAL=USR1\n" in plan.text
    assert "export SLURM_ELASTIC_SIGNAL_LEAD_S=300\n" in plan.text
    assert plan.request.overrides["preempt_signal"] == "SIGUSR1"


def test_python_sets_the_launcher_and_module_runs_python_dash_m() -> None:
    plan = plan_submission("pkg.train", module=True, python="/opt/py/bin/python3", **COMMON)
    assert plan.text.rstrip().endswith(
        "exec /opt/py/bin/python3 -m slurm_elastic.cli.main agent -m pkg.train"
    )
    assert "command -v /opt/py/bin/python3 " in plan.text
    own = plan_submission("t.py", python="python3", launcher="/x/slurm-elastic", **COMMON)
    assert own.text.rstrip().endswith("exec /x/slurm-elastic agent t.py")


def test_user_values_reach_the_request_and_unknown_keys_fail() -> None:
    request = build_request(
        {"entrypoint": "t.py", "args": "--lr 0.1", "max_restarts": 5, "nnodes": "2:3"}
    )
    assert request.args == ("--lr", "0.1")
    assert request.overrides == {"max_restarts": 5, "min_nodes": 2, "max_nodes": 3}
    with pytest.raises(ConfigError, match=r"unknown value 'max_restart'.*did you mean"):
        build_request({"entrypoint": "t.py", "max_restart": 5})
    with pytest.raises(ConfigError, match=r"unknown mode 'arrays'"):
        build_request({"entrypoint": "t.py"}, mode="arrays")
    with pytest.raises(ConfigError, match=r"needs a value for 'entrypoint'"):
        build_request({})


def test_sbatch_args_and_bad_time() -> None:
    plan = plan_submission("t.py", sbatch_args=["--mail-type=END", "--hold"], **COMMON)
    d = _directives(plan.text)
    assert d["mail-type"] == "END"
    assert "hold" in d
    with pytest.raises(ConfigError, match=r"time 'soon'"):
        plan_submission("t.py", time="soon", **COMMON)


@pytest.mark.parametrize(
    ("text", "minutes"),
    [("90", 90), ("1:30", 2), ("02:00:00", 120), ("1-12", 2160), ("1-00:30", 1470), (45, 45)],
)
def test_slurm_time_forms(text: object, minutes: int) -> None:
    assert slurm_time_minutes(text) == minutes


def test_local_dry_run_lists_one_agent_per_node(tmp_path: Path) -> None:
    plan = plan_submission("t.py", cluster="local", folder=tmp_path, nnodes="1:3")
    assert plan.cluster == "local"
    commands = [ln for ln in plan.text.splitlines() if "slurm_elastic.cli.node" in ln]
    assert len(commands) == 3
    assert f'"rdzv_endpoint": "{tmp_path / "rdzv"}"' in plan.text
    assert not list(tmp_path.iterdir()), "a dry run must not create anything"


def test_submit_from_config_dry_run_prints_sbatch(tmp_path: Path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(
        "mode: elastic\nentrypoint: train.py\nnnodes: '1:2'\npartition: gpu\n"
        f"output_dir: {tmp_path / 'logs'}\nmax_restarts: 2\n"
    )
    out = io.StringIO()
    assert submit_from_config(cfg, cluster="slurm", dry_run=True, out=out) == 0
    d = _directives(out.getvalue())
    assert (d["nodes"], d["partition"]) == ("1-2", "gpu")
    assert not (tmp_path / "logs").exists()
    with pytest.raises(ConfigError, match=r"does not exist"):
        submit_from_config(tmp_path / "missing.yaml", dry_run=True, out=out)


class _Client:
    def __init__(self, up: bool) -> None:
        self.up = up

    def ping(self) -> bool:
        return self.up


def test_cluster_auto_is_local_without_slurm_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert resolve_cluster(None) == "local"
    assert resolve_cluster("slurm") == "slurm"
    with pytest.raises(ConfigError, match=r"cluster 'cloud'"):
        resolve_cluster("cloud")


def test_cluster_auto_asks_the_controller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # sbatch/srun present on PATH (stand-ins), controller up or down (fake seam client)
    for tool in ("sbatch", "srun"):
        (tmp_path / tool).write_text("#!/bin/sh\nexit 1\n")
        (tmp_path / tool).chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert resolve_cluster("auto", client=_Client(up=True)) == "slurm"
    assert resolve_cluster("auto", client=_Client(up=False)) == "local"


def test_cli_render_and_submit_dry_run_through_main(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from slurm_elastic.cli.main import main

    cfg = tmp_path / "job.yaml"
    cfg.write_text("entrypoint: train.py\nnnodes: '1:3'\nargs: [--lr, '0.1']\n")
    assert main(["render", "elastic_array", "--config", str(cfg), "--set", "exclusive=true"]) == 0
    text = capsys.readouterr().out
    assert "#SBATCH --array=0-2\n" in text
    assert "#SBATCH --exclusive\n" in text
    assert text.rstrip().endswith("exec slurm-elastic agent train.py --lr 0.1")
    assert main(["render", "elastic_array", "--config", str(cfg)]) == 0
    rendered = capsys.readouterr().out
    assert main(["submit", str(cfg), "--cluster", "slurm", "--dry-run"]) == 0
    assert capsys.readouterr().out == rendered  # one generator: the same script


def test_log_paths_are_the_scripts_output_pattern_expanded(tmp_path: Path) -> None:
    from slurm_elastic.submit import slurm_backend

    array = build_request({"entrypoint": "t.py", "nnodes": "1:3", "job_name": "j"})
    paths = slurm_backend.log_paths(slurm_backend.plan(array), "42")
    assert paths == [Path.cwd() / f"j-42_{i}.out" for i in range(3)]
    one = build_request({"entrypoint": "t.py", "output_dir": str(tmp_path)}, mode="elastic")
    assert slurm_backend.log_paths(slurm_backend.plan(one), "7") == [
        tmp_path / "slurm-elastic-7.out"
    ]


class _Recorder:
    """The Slurm seam, recording what a submission sends (sbatch itself: test_cluster.py)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, str]]] = []

    def submit(self, script: str, extra_args: object = (), *, cwd: object = None,
               env: dict[str, str] | None = None) -> str:  # fmt: skip
        self.sent.append((script, dict(env or {})))
        return str(100 + len(self.sent))


def test_each_submission_carries_its_own_id_outside_the_script(tmp_path: Path) -> None:
    """The agents tell a job from an earlier one whose id Slurm repeats by an id of the
    submission (agent/run_owner.py); the script stays the dry run's text."""
    from slurm_elastic.envvars import SUBMISSION_ENV
    from slurm_elastic.submit import slurm_backend

    request = build_request({"entrypoint": "t.py", "output_dir": str(tmp_path)})
    planned = slurm_backend.plan(request)
    control = _Recorder()
    slurm_backend.send(planned, control)  # type: ignore[arg-type]
    slurm_backend.send(planned, control)  # type: ignore[arg-type]
    (text1, env1), (text2, env2) = control.sent
    assert text1 == text2 == planned.text
    assert SUBMISSION_ENV not in planned.text
    assert re.fullmatch(r"[0-9a-f]{16}", env1[SUBMISSION_ENV]), env1
    assert env1[SUBMISSION_ENV] != env2[SUBMISSION_ENV]
