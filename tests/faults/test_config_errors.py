"""Fault matrix, malformed configuration and flags.

On the submission side (the real CLI, in a subprocess): each malformed job file or flag
exits 2 with one line naming the key, the bad value and the fix, no traceback, and
submits nothing. Inside a real Slurm job: a malformed ``SLURM_ELASTIC_*`` value in the
job's environment makes the agent exit ``USAGE`` (2) at once, the message is in the
task's log, nothing is requeued and nothing stays in the queue.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_elastic.exit_codes import ExitCode
from slurm_elastic.slurm.jobstate import JobState
from tests.conftest import SlurmCluster
from tests.faults.harness import FaultRun, processes_mentioning
from tests.helpers import wait_for

CLI = [sys.executable, "-m", "slurm_elastic.cli.main"]

# (job-file text or None, extra CLI args, extra env, substrings the one error line must hold)
CASES = {
    "nnodes_reversed": ('entrypoint: x.py\nnnodes: "4:2"\n', [], {}, ["max_nodes", "2", "nnodes"]),
    "not_an_int": (
        "entrypoint: x.py\nmax_restarts: lots\n",
        [],
        {},
        ["max_restarts", "'lots'", "int"],
    ),
    "bad_yaml": ("entrypoint: [x.py\n", [], {}, ["not valid YAML", "line"]),
    "typo_key": (
        "entrypoint: x.py\nheartbeat_miss_limt: 3\n",
        [],
        {},
        ["heartbeat_miss_limt", "did you mean heartbeat_miss_limit"],
    ),
    "flag_nnodes": (None, ["--nnodes", "0:x"], {}, ["nnodes", "'0:x'", "MIN:MAX"]),
    "flag_run_id": (None, ["--rdzv-id", "a/b"], {}, ["run_id", "'a/b'", "letters, digits"]),
    "env_value": (
        None,
        [],
        {"SLURM_ELASTIC_MAX_RESTARTS": "lots"},
        ["max_restarts", "'lots'", "environment"],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_config_or_flag_is_one_clear_line(case: str, tmp_path: Path) -> None:
    text, flags, env, wanted = CASES[case]
    if text is not None:
        job = tmp_path / "job.yaml"
        job.write_text(text)
        argv = [*CLI, "submit", str(job), "--dry-run"]
    else:
        argv = [*CLI, "agent", "--nnodes", "1", "--rdzv-id", "x", *flags, "x.py"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "SLURM_ELASTIC"))}
    proc = subprocess.run(
        argv, capture_output=True, text=True, env={**clean, **env}, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == ExitCode.USAGE, proc
    assert "Traceback" not in proc.stderr, proc.stderr
    for piece in wanted:
        assert piece in proc.stderr, f"{piece!r} not in {proc.stderr!r}"


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_malformed_value_inside_a_job_fails_fast_and_clearly(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run = FaultRun(
        slurm_cluster,
        tmp_path / "run",
        steps=50,
        values={
            "nnodes": "1:1",
            "nproc_per_node": 1,
            "cpus_per_task": 1,
            "setup": "export OMP_NUM_THREADS=1 SLURM_ELASTIC_MAX_REQUEUES=often",
        },
    )
    try:
        run.submit()
        info = slurm_cluster.wait_state(f"{run.job}_0", {s for s in JobState if s.is_terminal}, 180)
        log = run.logs()
        assert info.state == JobState.FAILED and info.exit_code.startswith("2:"), f"{info}\n{log}"
        assert "max_requeues" in log and "'often'" in log, log
        assert "Traceback" not in log, log
        assert not info.restarts, "a usage error must not be requeued"
        left = [
            q
            for q in slurm_cluster.client.queue()
            if q.array_job_id == run.job or q.job_id == run.job
        ]
        assert not left, left
        wait_for(lambda: not processes_mentioning(str(run.tmp)), 30, "no process left")
    finally:
        run.cleanup()


def test_a_bad_value_in_a_job_file_is_attributed_to_the_file(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("entrypoint: x.py\nmax_restarts: lots\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    proc = subprocess.run(
        [*CLI, "submit", str(job), "--dry-run"],
        capture_output=True,
        text=True,
        env=clean,
        timeout=120,
    )
    assert proc.returncode == ExitCode.USAGE, proc
    assert "command line" not in proc.stderr and str(job) in proc.stderr, proc.stderr
    assert "max_restarts" in proc.stderr and "'lots'" in proc.stderr, proc.stderr
