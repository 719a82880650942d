"""Fault matrix, the agent's signal path on this machine (no Slurm: fast, in every suite).

Real agents (``slurm-elastic agent``), real workers, the real rendered
``elastic_array`` script run by bash. The Slurm counterparts of these cases (a real
preemption of a task without ``scontrol``, a real early notice) are in
``test_array_faults.py`` and ``test_time_limit.py``.

* A notice before the agent can handle it (during the job script's ``setup``, or while
  Python imports torch) must neither kill the task (the default action of USR2: Slurm
  would not requeue it) nor be lost: the agent acts on it once it can.
* A self-requeue that fails (``scontrol`` missing, as in containers) must not end the
  task during the grace time: the agent says so once, clearly, and stays until Slurm's
  own SIGTERM ends the task (which Slurm then requeues on a preemption).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_elastic.agent import ExitCode
from slurm_elastic.submit import render
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "agent" / "worker.py"
NOT_FOUND = "'scontrol' was not found on PATH"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


def _job_script(tmp: Path, setup: str) -> Path:
    """The real elastic_array script for one node, runnable by bash outside Slurm."""
    text = render.render_template(
        "elastic_array",
        {
            "entrypoint": str(WORKER),
            "args": [str(tmp), "10000"],
            "launcher": f"{sys.executable} -m slurm_elastic.cli.main",
            "setup": setup,
            "nnodes": "1:1",
            "nproc_per_node": 1,
            "run_id": "early",
            "state_dir": str(tmp / "state"),
            "output_dir": str(tmp / "logs"),
        },
    )
    script = tmp / "job.sbatch"
    script.write_text(text)
    return script


def _wait_exec(proc: subprocess.Popen[bytes]) -> None:
    """Wait until the script has exec'd Python (the agent is importing torch)."""

    def python_runs() -> bool:
        try:
            cmd = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        except OSError:
            return False
        return b"slurm_elastic.cli.main" in cmd and not cmd.startswith(b"env")

    wait_for(python_runs, 60, "the job script to exec the agent", interval=0.001)


@pytest.mark.parametrize("when", ["during_setup", "during_agent_start"])
def test_a_notice_before_the_agent_handles_it_is_held_then_acted_on(
    tmp_path: Path, when: str
) -> None:
    setup = "export OMP_NUM_THREADS=1"
    if when == "during_setup":  # Slurm's notice while `setup` runs (e.g. a slow module load)
        setup += "\nkill -s USR2 $$"
    script = _job_script(tmp_path, setup)
    log = tmp_path / "job.out"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["bash", str(script)], stdout=out, stderr=subprocess.STDOUT, env=_clean_env()
        )
        try:
            if when == "during_agent_start":
                _wait_exec(proc)
                os.kill(proc.pid, signal.SIGUSR2)  # Python is still importing torch
            rc = proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text(errors="replace")
    # Outside Slurm there is nothing to requeue: PREEMPTED (in Slurm: PREEMPTED_REQUEUED).
    # Before the fix: killed by the signal (rc -12), the task lost.
    assert rc == ExitCode.PREEMPTED, f"rc {rc}\n{text}"
    assert "arrived while the agent was starting: acting on it now" in text, text
    assert not (tmp_path / "records.jsonl").exists(), "workers started despite the notice"


def test_a_failed_self_requeue_waits_for_slurms_sigterm(tmp_path: Path) -> None:
    # As in a container: in a Slurm job (SLURM_JOB_ID), but no scontrol on PATH.
    env = _clean_env(SLURM_JOB_ID="4242", PATH=os.path.dirname(sys.executable))
    argv = [
        sys.executable, "-m", "slurm_elastic.cli.main", "agent",
        "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-id", "norequeue",
        "--local-addr", "127.0.0.1", "--monitor-interval", "0.1",
        "--state-dir", str(tmp_path / "state"), "--max-restarts", "0",
        str(WORKER), str(tmp_path), "10000",
    ]  # fmt: skip
    log = tmp_path / "agent.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        try:
            wait_for(lambda: (tmp_path / "step").exists(), 90, "training to make progress")
            os.kill(proc.pid, signal.SIGUSR2)  # the notice: the workers save, the agent leaves
            wait_for(
                lambda: NOT_FOUND in log.read_text(errors="replace") or proc.poll() is not None,
                90,
                "the agent to try its own requeue",
            )
            text = log.read_text(errors="replace")
            # Before the fix the agent exited here (during Slurm's GraceTime), and Slurm
            # did not requeue the task; now it stays until Slurm ends the task.
            assert proc.poll() is None, f"the agent exited after the failed requeue\n{text}"
            os.kill(proc.pid, signal.SIGTERM)  # Slurm's SIGTERM at the end of GraceTime
            rc = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text(errors="replace")
    assert rc == ExitCode.PREEMPTED, f"rc {rc}\n{text}"
    clear = [line for line in text.splitlines() if "cannot requeue 4242 myself" in line]
    assert len(clear) == 1 and NOT_FOUND in clear[0] and "PATH" in clear[0], text
    assert "Slurm ended the task (SIGUSR2, SIGTERM)" in text, text
    assert "Traceback" not in text, text
