"""Fixtures for agent tests: run ``slurm-elastic agent`` as real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import read_jsonl

WORKER = Path(__file__).with_name("worker.py")


class AgentRun:
    """One agent process (one "node") running tests/agent/worker.py."""

    def __init__(
        self,
        out: Path,
        rdzv: Path,
        run_id: str,
        nnodes: str,
        *extra: str,
        steps: int = 40,
        behaviour: str = "",
        node: str = "n0",
        env: dict[str, str] | None = None,
        backend: str = "slurm",
        endpoint: str | None = None,
    ) -> None:
        self.out = out
        argv = [
            sys.executable,
            "-m",
            "slurm_elastic.cli.main",
            "agent",
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            backend,
            "--rdzv-endpoint",
            endpoint or str(rdzv),
            "--rdzv-id",
            run_id,
            "--local-addr",
            "127.0.0.1",
            "--monitor-interval",
            "0.1",
            "--state-dir",
            str(out / "state"),
            "--max-restarts",
            "0",
            *(
                ["--rdzv-conf", "heartbeat_interval=0.5,heartbeat_miss_limit=3,last_call_timeout=1"]
                if backend == "slurm"
                else ["--rdzv-conf", "last_call_timeout=1"]
            ),
            *extra,
            str(WORKER),
            str(out),
            str(steps),
            behaviour,
        ]
        self.log = open(out / f"agent-{node}.log", "ab")  # noqa: SIM115 - closed in wait()
        child_env = {**os.environ, "OMP_NUM_THREADS": "1", "TEST_NODE_NAME": node, **(env or {})}
        for key in [k for k in child_env if k.startswith("SLURM")]:
            child_env.pop(key)  # these tests run outside Slurm, whatever the shell is
        self.proc = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True
        )

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


def single_agent(
    run_id: str, script: Path, *extra: str, **env: str
) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` of one agent with one worker running ``script`` outside Slurm
    (this checkout importable, no ``SLURM_*`` variables, ``env`` added)."""
    child = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    child.update(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]), **env)
    argv = [sys.executable, "-m", "slurm_elastic.cli.main", "agent", "--nnodes", "1"]
    argv += ["--nproc-per-node", "1", "--rdzv-id", run_id, "--local-addr", "127.0.0.1"]
    argv += ["--max-restarts", "0", *extra, str(script)]
    return argv, child


def records(out: Path) -> list[dict[str, Any]]:
    return read_jsonl(out / "records.jsonl")


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[list[AgentRun]]:
    started: list[AgentRun] = []
    yield started
    for run in started:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, 9)
    # workers run in their own sessions: kill any the agents left behind
    subprocess.run(["pkill", "-9", "-f", str(tmp_path)], check=False)


def agent_log(run: AgentRun) -> str:
    return "".join(p.read_text(errors="replace") for p in run.out.glob("agent-*.log"))
