"""Every CLI error is one line naming the value and the fix, exit 2, never a traceback
(issue #12 items 6-8).

Each case runs through ``main(argv)`` in this process; the few that need a real agent
process (a read-only rendezvous root, a late agent of a finished run) run the same
``main`` as ``python -m slurm_elastic.cli.main`` and check its stderr and exit status.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_elastic.cli.main import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_slurm_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Outside any Slurm job, in an empty directory, with no stray SLURM_ELASTIC_* config."""
    for name in [k for k in os.environ if k.startswith("SLURM")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def _error(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    """Run main(argv); assert exit 2 and one stderr line holding every needle."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, f"{argv}: exit {code}\n{err}"
    assert len(lines) == 1, f"{argv}: not one line:\n{err}"
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], f"{argv}: {needle!r} not in {lines[0]!r}"
    return lines[0]


def _job(tmp_path: Path, text: str, name: str = "job.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------ item 6


@pytest.mark.parametrize("verb", ["render", "config"])
def test_bad_yaml_files(verb: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nope.yaml")
    _error(capsys, [verb, "--config", missing], repr(missing), "does not exist")
    bad = _job(tmp_path, "entrypoint: [train.py\nmode: x\n", "bad.yaml")
    _error(capsys, [verb, "--config", bad], "bad.yaml", "not valid YAML", "line")
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x81binary\x00")
    _error(capsys, [verb, "--config", str(binary)], "bin.yaml", "not")
    listed = _job(tmp_path, "- entrypoint: train.py\n", "list.yaml")
    _error(capsys, [verb, "--config", listed], "list.yaml", "mapping")


def test_submit_bad_yaml_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x81binary\x00")
    _error(capsys, ["submit", str(binary), "--dry-run"], "bin.yaml")
    listed = _job(tmp_path, "- entrypoint: train.py\n", "list.yaml")
    _error(capsys, ["submit", listed, "--dry-run"], "list.yaml", "mapping")


def test_render_output_into_a_missing_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = _job(tmp_path, "entrypoint: train.py\n")
    target = str(tmp_path / "no" / "such" / "job.sbatch")
    _error(capsys, ["render", "elastic", "--config", job, "-o", target], target, "mkdir")


@pytest.mark.parametrize("flag", ["--redirects", "--tee"])
def test_agent_redirects_out_of_range(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    _error(capsys, ["agent", "--rdzv-id", "r", flag, "9", "t.py"], f"{flag} '9'", "0, 1, 2 or 3")


@pytest.mark.parametrize(
    "argv",
    [
        ["--join-timeout", "inf"],
        ["--join-timeout", "nan"],
        ["--rdzv-conf", "heartbeat_interval=inf"],
        ["--rdzv-conf", "join_timeout=inf"],
    ],
)
def test_infinite_durations(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    value = argv[1].split("=")[-1]
    _error(capsys, ["agent", "--rdzv-id", "r", *argv, "t.py"], value, "finite")


def test_infinite_duration_in_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = _job(tmp_path, "heartbeat_interval_s: .inf\n")
    _error(capsys, ["config", "--config", job], "heartbeat_interval_s", "inf", "finite")


def test_submit_job_file_with_a_cluster_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = _job(tmp_path, "entrypoint: train.py\ncluster: local\n")
    _error(capsys, ["submit", job, "--dry-run"], "'cluster'", "--cluster")


def test_agent_on_a_read_only_rendezvous_root(tmp_path: Path) -> None:
    """As root a chmod is no obstacle: /proc is a real read-only place for everyone."""
    (tmp_path / "t.py").write_text("print('never runs')\n")
    proc = _agent_process(tmp_path, "--rdzv-id", "ro", "--rdzv-endpoint", "/proc/rdzv", "t.py")
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "ERROR" in ln or "error" in ln]
    assert len(lines) == 1 and "/proc/rdzv" in lines[0] and "writable" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------ item 7


def test_yaml_sexagesimal_scalars_stay_strings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """YAML 1.1 reads 1:4 as 64 and 4:00:00 as 14400: --array=0-63 and a 10-day limit."""
    job = _job(tmp_path, "entrypoint: train.py\nnnodes: 1:4\ntime: 4:00:00\n")
    assert main(["render", "elastic_array", "--config", job]) == 0
    text = capsys.readouterr().out
    assert "#SBATCH --array=0-3\n" in text
    assert "#SBATCH --time=4:00:00\n" in text
    assert main(["config", "--config", job]) == 0
    assert '"max_nodes": 4' in capsys.readouterr().out
    assert main(["submit", job, "--dry-run", "--cluster", "local"]) == 0
    assert "# local job: 4 agents" in capsys.readouterr().out
    plain = _job(tmp_path, "nnodes: 2:8\nrun_id: r\n", "plain.yaml")  # agent --config's kind
    assert main(["config", "--config", plain]) == 0
    assert '"max_nodes": 8' in capsys.readouterr().out


def test_unknown_rdzv_conf_key_is_refused_with_the_closest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = _error(
        capsys,
        ["agent", "--rdzv-id", "r", "--rdzv-conf", "heartbeat_intervall=1", "t.py"],
        "heartbeat_intervall",
    )
    assert "did you mean heartbeat_interval" in line


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("state_dir: {a: 1}\n", "state_dir"),
        ("run_id: [a, b]\n", "run_id"),
        ("max_restarts: 2.5\n", "max_restarts"),
        ("nnodes: [1, 4]\n", "nnodes"),
    ],
)
def test_wrong_types_are_refused(
    text: str, key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = _job(tmp_path, text)
    _error(capsys, ["config", "--config", job], repr(key))


def test_wrong_types_of_template_keys_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = _job(tmp_path, "entrypoint: train.py\njob_name: {a: 1}\n")
    _error(capsys, ["render", "elastic", "--config", job], "'job_name'", "string")


@pytest.mark.parametrize(
    "argv",
    [
        ["--nnodes", "99999999999999999999"],
        ["--nnodes", "1:99999999999999999999"],
        ["--nproc-per-node", "99999999999999999999"],
        ["--join-timeout", "1e300"],
        ["--max-restarts", "99999999999999999999"],
    ],
)
def test_absurd_values_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    _error(capsys, ["config", "--rdzv-id", "r", *argv], "at most")


# ------------------------------------------------------------------ item 8


def test_agent_without_a_run_id(capsys: pytest.CaptureFixture[str]) -> None:
    _error(capsys, ["agent", "t.py"], "run id", "--rdzv-id")


def test_agent_c10d_without_an_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    _error(
        capsys, ["agent", "--rdzv-id", "r", "--rdzv-backend", "c10d", "t.py"], "c10d", "HOST:PORT"
    )


def test_agent_invalid_miss_limit(capsys: pytest.CaptureFixture[str]) -> None:
    _error(
        capsys,
        ["agent", "--rdzv-id", "r", "--rdzv-conf", "heartbeat_miss_limit=1", "t.py"],
        "heartbeat_miss_limit",
        "'1'",
    )


def _agent_process(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "slurm_elastic.cli.main", "-q", "agent", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.slow
def test_late_agent_of_a_finished_run_exits_0(tmp_path: Path) -> None:
    """A second agent of the same incarnation (e.g. a late srun task) finds the run
    closed: the run is finished, so that is success (0), not RENDEZVOUS_FAILED (6)."""
    (tmp_path / "t.py").write_text("print('trained', flush=True)\n")
    argv = [
        "--rdzv-id",
        "late",
        "--rdzv-endpoint",
        str(tmp_path / "rdzv"),
        "--rdzv-conf",
        "incarnation=job-1.0,last_call_timeout=0.1",
        "--nproc-per-node",
        "1",
        "t.py",
    ]
    first = _agent_process(tmp_path, *argv)
    assert first.returncode == 0, first.stderr
    late = _agent_process(tmp_path, *argv)
    assert late.returncode == 0, late.stderr
    assert "trained" not in late.stdout
    assert "Traceback" not in late.stderr


def test_output_into_a_closed_pipe_is_not_an_error(tmp_path: Path) -> None:
    """`slurm-elastic config | head` used to print 'error: Broken pipe; check the path'.
    ``true`` exits before the CLI has started, so its output meets a closed pipe."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        f"{sys.executable} -m slurm_elastic.cli.main config --rdzv-id r | true",
        shell=True,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stderr == ""
