"""sbatch template rendering (slurm_elastic.submit.render).

Golden files live in tests/data/golden/<case>.sbatch. After an intended template change,
regenerate them with

    UPDATE_GOLDEN=1 .venv/bin/pytest tests/submit/test_render.py

and review the diff before committing.

The behaviour tests run the rendered scripts with the real bash; only ``srun`` is replaced
by a stand-in on PATH (it drops its own options and execs the agent command, so the
script's signal forwarding reaches a real process), because srun needs a Slurm allocation.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slurm_elastic.errors import ConfigError
from slurm_elastic.submit import render
from tests.helpers import wait_for

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "golden"
REPO = Path(__file__).resolve().parents[2]

CASES: dict[str, tuple[str, dict[str, object]]] = {
    "fault_tolerant": ("fault_tolerant", {"entrypoint": "train.py", "args": ["--epochs", "10"]}),
    "elastic": ("elastic", {"entrypoint": "train.py", "args": ["--epochs", "10"]}),
    "elastic_array": ("elastic_array", {"entrypoint": "train.py", "args": ["--epochs", "10"]}),
    "elastic_array_options": (
        "elastic_array",
        {
            "entrypoint": "examples/train.py",
            "args": "--lr 0.1 --name 'my run'",
            "nnodes": "2:8",
            "job_name": "llm",
            "preempt_signal": "SIGUSR1",
            "signal_lead_s": 300,
            "output_dir": "/scratch/me/logs",
            "setup": ["module load cuda", "source .venv/bin/activate"],
            "partition": "gpu",
            "account": "proj1",
            "time": "04:00:00",
            "gpus_per_node": 8,
            "cpus_per_task": 32,
            "exclusive": True,
            "sbatch_args": ["--mail-type=END"],
            "env": {"NCCL_DEBUG": "WARN"},
            "requeue": "always",
            "hang_timeout_s": 600,
            "state_dir": "/scratch/me/state",
        },
    ),
    "elastic_options": (
        "elastic",
        {
            "entrypoint": "train.py",
            "min_nodes": 2,
            "max_nodes": 3,
            "cpus_per_task": 16,
            "srun_args": ["--cpu-bind=none"],
            "launcher": "python -m slurm_elastic.cli",
        },
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_template_matches_golden_file(case: str) -> None:
    name, values = CASES[case]
    text = render.render_template(name, values)
    golden = GOLDEN / f"{case}.sbatch"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"no golden file {golden}; run with UPDATE_GOLDEN=1"
    assert text == golden.read_text()


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_script_is_valid_bash_with_required_directives(case: str) -> None:
    name, values = CASES[case]
    text = render.render_template(name, values)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    for directive in ("--requeue", "--open-mode=append", "--ntasks-per-node=1"):
        assert f"#SBATCH {directive}\n" in text
    assert "#SBATCH --signal=B:USR" in text
    assert "${" not in text.replace("${SRUN", "")  # no placeholder left behind
    # sbatch stops reading directives at the first command: all must come first
    lines = text.splitlines()
    first_command = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith("#"))
    assert all(not ln.startswith("#SBATCH") for ln in lines[first_command:])


def test_array_template_shape() -> None:
    text = render.render_template("elastic_array", {"entrypoint": "t.py", "max_nodes": 6})
    assert "#SBATCH --array=0-5\n" in text
    assert "#SBATCH --nodes=1\n" in text
    assert "#SBATCH --output=%x-%A_%a.out\n" in text
    assert "\nexec slurm-elastic agent t.py\n" in text
    assert "export SLURM_ELASTIC_MAX_NODES=6\n" in text
    assert "srun" not in text


def test_allocation_templates_run_one_agent_per_node_through_srun() -> None:
    for name, nodes_line in (("fault_tolerant", "--nodes=4"), ("elastic", "--nodes=1-4")):
        text = render.render_template(name, {"entrypoint": "t.py"})
        assert f"#SBATCH {nodes_line}\n" in text
        assert "#SBATCH --output=%x-%j.out\n" in text
        assert "srun --ntasks-per-node=1 --kill-on-bad-exit=0" in text


def test_fault_tolerant_is_4_nodes_of_8_trainers_by_default() -> None:
    values = render.template_values("fault_tolerant", {"entrypoint": "t.py"})
    assert (values["nodes"], values["nproc_per_node"]) == ("4", "8")
    assert "SLURM_ELASTIC_MIN_NODES=4" in values["env_exports"]
    assert "SLURM_ELASTIC_MAX_RESTARTS=3" in values["env_exports"]


def test_list_templates_matches_files_in_sbatch_templates() -> None:
    files = sorted(p.stem for p in (REPO / "sbatch_templates").glob("*.sbatch"))
    assert render.list_templates() == files == ["elastic", "elastic_array", "fault_tolerant"]


def test_unknown_template_names_choices() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown sbatch template 'elastik'; did you mean 'elastic'\?"
    ):
        render.render_template("elastik", {"entrypoint": "t.py"})


def test_missing_entrypoint_names_key_and_fix() -> None:
    with pytest.raises(ConfigError, match=r"needs a value for 'entrypoint'.*--set entrypoint="):
        render.render_template("elastic", {})


def test_unknown_key_suggests_closest() -> None:
    with pytest.raises(ConfigError, match=r"unknown value 'partiton'.*did you mean partition"):
        render.render_template("elastic", {"entrypoint": "t.py", "partiton": "gpu"})


def test_config_values_are_validated_by_the_config() -> None:
    with pytest.raises(ConfigError, match=r"'max_nodes' = 1: must be >= min_nodes \(2\)"):
        render.render_template("elastic", {"entrypoint": "t.py", "min_nodes": 2, "max_nodes": 1})
    with pytest.raises(ConfigError, match=r"preempt_signal"):
        render.render_template("elastic", {"entrypoint": "t.py", "preempt_signal": "USR9"})


def test_min_nodes_above_default_max_raises_max() -> None:
    values = render.template_values("elastic", {"entrypoint": "t.py", "min_nodes": 6})
    assert (values["min_nodes"], values["max_nodes"]) == ("6", "6")


def test_node_count_conflicts_are_explained() -> None:
    with pytest.raises(ConfigError, match=r"fixed number of nodes \(nodes=4\).*use the 'elastic'"):
        render.render_template("fault_tolerant", {"entrypoint": "t.py", "min_nodes": 2})
    with pytest.raises(ConfigError, match=r"takes a node range: set min_nodes/max_nodes"):
        render.render_template("elastic", {"entrypoint": "t.py", "nodes": 3})


def test_mode_value_must_match_template() -> None:
    assert render.render_template("elastic", {"entrypoint": "t.py", "mode": "elastic"})
    with pytest.raises(ConfigError, match=r"mode 'elastic_array' but template 'elastic'"):
        render.render_template("elastic", {"entrypoint": "t.py", "mode": "elastic_array"})


def test_config_log_dir_is_exported_not_confused_with_output_dir() -> None:
    text = render.render_template("elastic", {"entrypoint": "t.py", "log_dir": "/w/logs"})
    assert "export SLURM_ELASTIC_LOG_DIR=/w/logs\n" in text
    assert "#SBATCH --output=%x-%j.out\n" in text


def test_newline_in_single_line_value_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"'job_name'.*must be a single line"):
        render.render_template("elastic", {"entrypoint": "t.py", "job_name": "a\n#SBATCH --x"})


def test_string_booleans_from_the_command_line() -> None:
    on = render.render_template("elastic", {"entrypoint": "t.py", "exclusive": "true"})
    off = render.render_template("elastic", {"entrypoint": "t.py", "exclusive": "false"})
    assert "#SBATCH --exclusive\n" in on
    assert "--exclusive" not in off
    with pytest.raises(ConfigError, match=r"'exclusive' = 'maybe': expected true or false"):
        render.render_template("elastic", {"entrypoint": "t.py", "exclusive": "maybe"})


def test_bad_env_name_and_bad_integer() -> None:
    with pytest.raises(ConfigError, match=r"invalid variable name 'A-B'"):
        render.render_template("elastic", {"entrypoint": "t.py", "env": {"A-B": "1"}})
    with pytest.raises(ConfigError, match=r"'signal_lead_s' = 'soon': expected an integer"):
        render.render_template("elastic", {"entrypoint": "t.py", "signal_lead_s": "soon"})


# -- behaviour of the rendered scripts under real bash ---------------------------------

AGENT = textwrap.dedent(
    """
    import os, signal, sys, time
    from slurm_elastic import notice
    notice.install_preemption_handler()
    # as slurm-elastic agent: the array script hands the notice over blocked (held)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})
    ready = os.environ["READY_FILE"]
    open(ready, "w").write(str(os.getpid()))
    deadline = time.monotonic() + 30
    while not notice.preemption_requested():
        if time.monotonic() > deadline:
            sys.exit(99)
        time.sleep(0.01)
    open(ready + ".notice", "w").write(" ".join(sys.argv[1:]))
    sys.exit(7)
    """
)

FAKE_SRUN = '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n'


def _run_rendered(tmp_path: Path, template: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    agent = tmp_path / "fake_agent.py"
    agent.write_text(AGENT)
    # launcher "python fake_agent.py" + "agent" subcommand word + entrypoint + args
    script = render.render_template(
        template,
        {
            "entrypoint": "train.py",
            "args": ["--x", "1"],
            "launcher": f"{sys.executable} {agent}",
            "env": {"READY_FILE": str(tmp_path / "ready")},
        },
    )
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([shutil.which("bash") or "bash", str(path)], env=env, cwd=tmp_path)
    try:
        wait_for((tmp_path / "ready").exists, 30, "the agent to start")
        # Slurm's --signal=B:USR2 goes to the batch shell only: do the same
        os.kill(proc.pid, signal.SIGUSR2)
        assert proc.wait(timeout=30) == 7, "the agent's exit code must be the job's"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (tmp_path / "ready.notice").read_text() == "agent train.py --x 1"


@pytest.mark.parametrize("template", ["elastic", "fault_tolerant"])
def test_allocation_script_forwards_preempt_signal_to_agents_and_returns_their_code(
    tmp_path: Path, template: str
) -> None:
    _run_rendered(tmp_path, template)


def test_array_script_agent_receives_batch_signal_directly(tmp_path: Path) -> None:
    _run_rendered(tmp_path, "elastic_array")


def test_templates_ship_in_the_wheel_identical_to_sbatch_templates(tmp_path: Path) -> None:
    # A non-editable install reads the templates from package data: build the real wheel.
    pytest.importorskip("setuptools")
    import zipfile

    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(REPO),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("slurm_elastic-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        shipped = {
            Path(n).name: zf.read(n).decode()
            for n in zf.namelist()
            if n.startswith("slurm_elastic/templates/")
        }
    canonical = {p.name: p.read_text() for p in (REPO / "sbatch_templates").glob("*.sbatch")}
    assert shipped == canonical


def test_fault_tolerant_takes_its_node_count_from_nnodes() -> None:
    """One job file for every template: ``nnodes: 2`` names fault_tolerant's fixed count."""
    for values in ({"nnodes": 2}, {"nnodes": "2:2"}, {"min_nodes": 2, "max_nodes": 2}):
        text = render.render_template("fault_tolerant", {"entrypoint": "t.py", **values})
        assert "#SBATCH --nodes=2\n" in text
    with pytest.raises(ConfigError, match=r"fixed number of nodes \(nodes=4\)"):
        render.render_template("fault_tolerant", {"entrypoint": "t.py", "nnodes": "1:4"})


@pytest.mark.parametrize("name", ["elastic_array", "elastic"])
def test_script_stops_with_a_message_when_setup_leaves_no_launcher(
    name: str, tmp_path: Path
) -> None:
    """A job whose environment lacks slurm-elastic says so instead of 'command not found'."""
    text = render.render_template(
        name,
        {"entrypoint": "t.py", "launcher": "no-such-launcher-xyz", "setup": "true"},
    )
    proc = subprocess.run(
        ["bash", "-c", text], cwd=tmp_path, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2
    assert "no-such-launcher-xyz is not on PATH" in proc.stderr
    assert "'setup'" in proc.stderr
