"""The README's "Use it on a real cluster" commands, run as written (issue #14).

The commands are not copied here: they are read from README.md, from the fenced blocks
marked ``<!-- tests/readme: NAME -->``, so these tests change with the README:

* ``job.yaml``: the job file every verb takes;
* ``sbatch``: config + render + ``sbatch`` (run for each template);
* ``submit``: ``slurm-elastic submit``;
* ``torchrun.sbatch``: the plain ``srun ... torchrun --rdzv-backend=slurm`` batch script.

Each Slurm test runs in an empty temporary directory, as a new user would, with the
README's job file and ``train.py`` = ``examples/train_ddp.py`` (the README's runnable
version of its train.py). The job file is the README's with only what this 2-core test
cluster needs changed (:data:`TINY`): a few training steps, one worker per node, two nodes,
and the template under test as ``mode``. The commands themselves run unchanged in bash.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slurm_elastic.cli.main import main
from slurm_elastic.slurm.jobstate import JobState as SlurmState
from tests.conftest import SlurmCluster

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
TRAIN = REPO / "examples" / "train_ddp.py"
BIN = Path(sys.executable).parent

_BLOCK = re.compile(r"<!-- tests/readme: (\S+) -->\n```[a-z]*\n(.*?)\n```", re.S)

#: What the test cluster needs changed in the README's job file (2 cores, 4 small nodes).
TINY: dict[str, object] = {"args": ["--steps", "20", "--save-every", "10"], "nproc_per_node": 1}
#: Node counts per template: both nodes must train, so the run cannot end before the
#: second array task starts (it would then be cancelled, not completed).
NODES = {"elastic_array": "2:2", "elastic": "2:2", "fault_tolerant": 2}


def readme_blocks() -> dict[str, str]:
    """The marked fenced blocks of README.md, by name."""
    return {name: body for name, body in _BLOCK.findall(README.read_text(encoding="utf-8"))}


def _job_file(directory: Path, mode: str | None = None) -> dict[str, object]:
    """Write the README's job.yaml (plus :data:`TINY` when ``mode``) and train.py."""
    job = yaml.safe_load(readme_blocks()["job.yaml"])
    if mode is not None:
        job.update(TINY, mode=mode, nnodes=NODES[mode])
    (directory / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    shutil.copy(TRAIN, directory / "train.py")
    return job


def _env(cluster: SlurmCluster) -> dict[str, str]:
    """The submitting shell: this checkout's package and CLI on the path, no stray config."""
    env = {k: v for k, v in cluster.env.items() if not k.startswith("SLURM_ELASTIC_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _bash(block: str, cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(
        ["bash", "-e", "-c", block], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"README commands failed:\n{block}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _wait_completed(cluster: SlurmCluster, refs: list[str], directory: Path) -> None:
    finished = {s for s in SlurmState if s.is_terminal}
    try:
        infos = [cluster.wait_state(ref, finished, timeout=300) for ref in refs]
    finally:
        cluster.client.run(["scancel", refs[0].split("_")[0]])
    logs = "\n".join(
        f"--- {p}\n{p.read_text(errors='replace')[-3000:]}"
        for p in sorted(directory.rglob("*.out"))
    )
    assert all(i.state is SlurmState.COMPLETED for i in infos), f"{infos}\n{logs or 'no logs'}"


# --------------------------------------------------------------- without Slurm


def test_readme_marks_the_blocks_these_tests_run() -> None:
    assert sorted(readme_blocks()) == ["job.yaml", "sbatch", "submit", "torchrun.sbatch"]
    assert "slurm-elastic render" in readme_blocks()["sbatch"]
    assert "sbatch job.sbatch" in readme_blocks()["sbatch"]
    assert "--rdzv-backend=slurm" in readme_blocks()["torchrun.sbatch"]


def test_one_job_file_serves_config_render_and_submit_dry_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``config`` used to reject the job file render/submit accept ('unknown config key')."""
    job = _job_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    for name in [k for k in os.environ if k.startswith("SLURM")]:
        monkeypatch.delenv(name)
    assert main(["config", "--config", "job.yaml"]) == 0
    config = json.loads(capsys.readouterr().out)
    low, high = str(job["nnodes"]).split(":")
    assert (config["min_nodes"], config["max_nodes"]) == (int(low), int(high))
    assert config["nproc_per_node"] == job["nproc_per_node"]
    assert main(["render", "--config", "job.yaml"]) == 0
    rendered = capsys.readouterr().out
    assert f"#SBATCH --array=0-{int(high) - 1}\n" in rendered
    assert main(["submit", "job.yaml", "--dry-run", "--cluster", "slurm"]) == 0
    assert capsys.readouterr().out == rendered  # one script: what submit sends
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml", "train.py"]


def test_config_prints_what_the_agent_in_the_rendered_job_resolves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same precedence as the job: the job file's exports beat the submitting shell's
    SLURM_ELASTIC_* variables; flags beat both. Checked against a real bash running the
    rendered script's export lines, then ``slurm-elastic config`` (what the agent resolves)."""
    _job_file(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(REPO),
        SLURM_ELASTIC_NPROC_PER_NODE="3",  # overridden by the job file's 8
        SLURM_ELASTIC_MAX_RESTARTS="7",  # not in the job file: applies
    )

    def run(*args: str) -> dict[str, object]:
        out = subprocess.run(
            args, cwd=tmp_path, env=env, capture_output=True, text=True, check=True, timeout=60
        ).stdout
        return dict(json.loads(out))

    from_file = run("slurm-elastic", "config", "--config", "job.yaml")
    script = subprocess.run(
        ["slurm-elastic", "render", "--config", "job.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    exports = [ln for ln in script.splitlines() if ln.startswith("export SLURM_ELASTIC_")]
    in_job = run("bash", "-c", "\n".join([*exports, "exec slurm-elastic config"]))
    assert from_file == in_job
    assert (from_file["nproc_per_node"], from_file["max_restarts"]) == (8, 7)
    flagged = run("slurm-elastic", "config", "--config", "job.yaml", "--nproc-per-node", "2")
    assert flagged["nproc_per_node"] == 2


def test_render_creates_the_log_and_working_directories_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Slurm opens --output/--error in --chdir before the script: missing -> silent failure."""
    _job_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    args = ["render", "--config", "job.yaml", "--set", "output_dir=logs/run1"]
    args += ["--set", "sbatch_args=--chdir=work --error=errs/%x-%j.err"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "#SBATCH --output=logs/run1/%x-%A_%a.out\n" in captured.out
    for path in ("work", "work/logs/run1", "work/errs"):
        assert (tmp_path / path).is_dir(), path
        assert f"created {tmp_path / path}/" in captured.err
    assert main(args) == 0  # existing directories: nothing to say
    assert "created" not in capsys.readouterr().err


# --------------------------------------------------------------- on the local Slurm


@pytest.mark.parametrize("template", ["elastic_array", "elastic", "fault_tolerant"])
@pytest.mark.slurm
@pytest.mark.slow
def test_readme_sbatch_path_from_an_empty_directory(
    slurm_cluster: SlurmCluster, tmp_path: Path, template: str
) -> None:
    """Issue #14: the rendered job failed at launch (no logs/ directory), silently."""
    job = _job_file(tmp_path, template)
    out = _bash(readme_blocks()["sbatch"], tmp_path, _env(slurm_cluster))
    job_id = re.search(r"Submitted batch job (\d+)", out)
    assert job_id, out
    refs = [f"{job_id[1]}_0", f"{job_id[1]}_1"] if template == "elastic_array" else [job_id[1]]
    _wait_completed(slurm_cluster, refs, tmp_path)
    logs = sorted(tmp_path.glob(f"{job.get('job_name', 'slurm-elastic')}-{job_id[1]}*.out"))
    assert len(logs) == len(refs), sorted(p.name for p in tmp_path.iterdir())
    text = "".join(p.read_text(errors="replace") for p in logs)
    assert "step 20 loss" in text, text[-3000:]


@pytest.mark.slurm
@pytest.mark.slow
def test_readme_submit_from_an_empty_directory(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    _job_file(tmp_path, "elastic_array")
    out = _bash(readme_blocks()["submit"], tmp_path, _env(slurm_cluster))
    assert "#SBATCH --array=0-1\n" in out  # the dry run
    job_id = re.search(r"submitted slurm job (\d+)", out)
    assert job_id, out
    _wait_completed(slurm_cluster, [f"{job_id[1]}_0", f"{job_id[1]}_1"], tmp_path)
    log_paths = [Path(p) for p in re.findall(r"log: (\S+)", out)]
    assert log_paths and all(p.is_file() for p in log_paths), out
    assert "step 20 loss" in "".join(p.read_text(errors="replace") for p in log_paths)


@pytest.mark.slurm
@pytest.mark.slow
def test_readme_plain_torchrun_batch_script(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The README's script as written; ``sbatch --nodes=2`` (a command-line option beats the
    script's ``#SBATCH --nodes=4``) leaves room on the shared 4-node test cluster."""
    shutil.copy(TRAIN, tmp_path / "train.py")
    (tmp_path / "torchrun.sbatch").write_text(readme_blocks()["torchrun.sbatch"] + "\n")
    env = _env(slurm_cluster)
    # torchrun's default log directory is a new torchelastic_* in the temporary directory
    env["TMPDIR"] = str(tmp_path / "tmp")
    (tmp_path / "tmp").mkdir(mode=0o700)
    out = _bash("sbatch --nodes=2 torchrun.sbatch", tmp_path, env)
    job_id = re.search(r"Submitted batch job (\d+)", out)
    assert job_id, out
    _wait_completed(slurm_cluster, [job_id[1]], tmp_path)
    log = (tmp_path / f"slurm-{job_id[1]}.out").read_text(errors="replace")
    assert "step 200 loss" in log, log[-3000:]
    assert any((tmp_path / "checkpoints").iterdir())
