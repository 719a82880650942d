"""Where the workers' output goes: always under the run's state directory, never torch's
default (a new ``torchelastic_*`` directory in the system's temporary directory per
agent start, which nothing removes: a suite run left ~27 of them). A real agent and
worker; the unit cases read the choice itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slurm_elastic.agent.run_files import worker_logs
from slurm_elastic.config import ElasticConfig
from tests.agent.conftest import single_agent


@pytest.mark.parametrize(
    ("run_id", "chosen", "expected"),
    [
        ("r1", ("0", "0"), ("logs/r1", "0", "3")),  # default: files, copied to the output
        ("r1", ("3", "0"), ("logs/r1", "3", "0")),  # the user's choice, in the same place
        (None, ("0", "0"), ("logs/run", "0", "0")),  # no run id: no copy, still no temp dir
        (None, ("1", "2"), ("logs/run", "1", "2")),
    ],
)
def test_worker_logs_are_under_the_state_directory(
    tmp_path: Path,
    run_id: str | None,
    chosen: tuple[str, str],
    expected: tuple[str, str, str],
) -> None:
    config = ElasticConfig(state_dir=tmp_path / "state", run_id=run_id)
    log_dir, redirects, tee = worker_logs(config, *chosen)
    assert (log_dir, redirects, tee) == (tmp_path / "state" / expected[0], *expected[1:])


def test_a_configured_log_dir_is_kept(tmp_path: Path) -> None:
    config = ElasticConfig(state_dir=tmp_path / "state", run_id="r1", log_dir=tmp_path / "mine")
    assert worker_logs(config, "3", "0") == (tmp_path / "mine", "3", "0")


def test_redirected_output_stays_with_the_run_and_leaves_no_temp_directory(
    tmp_path: Path,
) -> None:
    temp = tmp_path / "tmp"  # the agent's and workers' system temporary directory
    temp.mkdir(mode=0o700)
    script = tmp_path / "hello.py"
    script.write_text("print('hello from the worker', flush=True)\n")
    state = tmp_path / "state"
    argv, env = single_agent("redir", script, "--state-dir", str(state), "--redirects", "3")
    env["TMPDIR"] = str(temp)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr

    assert sorted(p.name for p in temp.iterdir() if p.name.startswith("torchelastic_")) == []
    files = list((state / "logs" / "redir").glob("redir_*/attempt_0/0/stdout.log"))
    assert len(files) == 1 and "hello from the worker" in files[0].read_text(), files
    shown = subprocess.run(
        [sys.executable, "-m", "slurm_elastic.cli.main", "logs", str(state)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert "hello from the worker" in shown.stdout
