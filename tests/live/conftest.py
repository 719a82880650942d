"""Fixtures for in-place membership tests: real agents running ``examples/train_ddp.py``.

Each :class:`LiveRun` is one "node": a ``slurm-elastic agent`` process with 2 gloo
workers; the nodes meet through the slurm rendezvous backend in a temporary directory
and share one ledger (every rank appends the sample indices of every step it ran).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from slurm_elastic import ledger as ledger_records
from tests.helpers import wait_for

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train_ddp.py"
DATASET, GLOBAL_BATCH = 200, 16
# The last call of a pair started together: round 0 waits this long for the second node.
# With the default 1 s, a node whose start-up (torch's import) lags by over a second on
# 2 loaded cores joins in place after the first has trained alone: a membership change
# the test did not make (a CI run saw it as an extra graceful re-formation).
TOGETHER_LAST_CALL_S = 60.0


class LiveRun:
    """One agent ("node") running examples/train_ddp.py with a ledger."""

    def __init__(
        self,
        tmp: Path,
        run_id: str,
        nnodes: str,
        node: str,
        *train_args: str,
        steps: int = 120,
        step_time: float = 0.05,
        agent_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        script: Path = TRAIN,
        last_call_s: float = 1.0,
    ) -> None:
        self.tmp = tmp
        self.node = node
        argv = [
            sys.executable, "-m", "slurm_elastic.cli.main", "agent",
            "--nnodes", nnodes, "--nproc-per-node", "2",
            "--rdzv-backend", "slurm", "--rdzv-endpoint", str(tmp / "rdzv"),
            "--rdzv-id", run_id, "--local-addr", "127.0.0.1",
            "--monitor-interval", "0.1", "--state-dir", str(tmp / "state"),
            "--max-restarts", "0",
            "--rdzv-conf",
            f"heartbeat_interval=0.5,heartbeat_miss_limit=3,last_call_timeout={last_call_s:g}",
            *agent_args,
            str(script),
            "--steps", str(steps), "--dataset-size", str(DATASET),
            "--global-batch", str(GLOBAL_BATCH), "--step-time", str(step_time),
            "--ledger", str(tmp / "ledger.jsonl"), "--out", str(tmp / "out.pt"),
            *train_args,
        ]  # fmt: skip
        self.log_path = tmp / f"agent-{node}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in wait()
        child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        for key in [k for k in child_env if k.startswith("SLURM")]:
            child_env.pop(key)  # these tests run outside Slurm, whatever the shell is
        child_env.update(env or {})
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True
        )

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def worker_pids(self) -> set[int]:
        """PIDs of this agent's workers (children of the agent process)."""
        out = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True, check=False
        ).stdout
        return {int(p) for p in out.split()}

    def kill_node(self) -> set[int]:
        """SIGKILL the agent and its workers (the whole node is gone); return worker pids."""
        pids = self.worker_pids()
        os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def freeze_node(self) -> set[int]:
        """SIGSTOP the agent and its workers (a silent loss: no socket is reset); return
        the worker pids. The ``nodes`` fixture's SIGKILL ends them (stopped or not)."""
        pids = self.worker_pids()
        os.killpg(self.proc.pid, signal.SIGSTOP)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        return pids


def ledger(tmp: Path) -> list[dict[str, Any]]:
    return ledger_records.read(tmp / "ledger.jsonl")


def steps_done(tmp: Path) -> int:
    return ledger_records.steps_done(ledger(tmp))


def wait_world_of_4(tmp: Path, min_steps: int = 0, timeout: float = 120) -> None:
    """Wait until 4 workers (2 nodes x 2) train in one world and ``min_steps`` are done."""
    wait_for(
        lambda: (
            len({r["pid"] for r in ledger(tmp) if r["world"] == 4}) == 4
            and steps_done(tmp) >= min_steps
        ),
        timeout,
        "a world of 4 training",
    )


def assert_each_sample_once(records: list[dict[str, Any]], steps: int) -> None:
    """Every step 1..steps ran once in its world, each sample once per epoch (the one
    checker: ``slurm_elastic.ledger.check``)."""
    problems = ledger_records.check(records, DATASET, steps=steps)
    assert not problems, problems


redone_steps = ledger_records.redone_steps


def reference_params(steps: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The uninterrupted run's math in this process (one rank, the same global batches)."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import train_ddp
    finally:
        sys.path.pop(0)
    from slurm_elastic.checkpoint import ElasticSampler

    args = train_ddp.parse_args(
        ["--dataset-size", str(DATASET), "--global-batch", str(GLOBAL_BATCH), "--seed", str(seed)]
    )
    x, y = train_ddp.synthetic_data(args)
    net = train_ddp.build_model(args)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
    sampler = ElasticSampler(DATASET, GLOBAL_BATCH, rank=0, world_size=1, seed=seed)
    done, epoch = 0, 0
    while done < steps:
        sampler.set_epoch(epoch, 0)
        for piece in sampler.slices():
            idx = piece.indices
            loss = ((net(x[idx]) - y[idx]) ** 2).sum() / piece.global_size
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            sched.step()
            done += 1
            if done >= steps:
                break
        epoch += 1
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def assert_close_to_reference(tmp: Path, steps: int) -> None:
    got = torch.load(tmp / "out.pt")
    ref = reference_params(steps)
    for key, value in ref.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=key)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[LiveRun]]:
    started: list[LiveRun] = []
    yield started
    for run in started:
        if run.proc.poll() is None:
            for pid in run.worker_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            os.killpg(run.proc.pid, signal.SIGKILL)
            run.proc.wait(10)
    # workers run in their own sessions: kill any the agents left behind (by pid)
    for pid in {r["pid"] for r in ledger(tmp_path)}:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(tmp_path).encode() in cmdline:  # still ours, not a reused pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
