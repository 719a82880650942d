"""examples/train_imagenet_style.py under the real agent (1 node x 2 gloo workers, no Slurm).

A run interrupted by the preemption notice (SIGUSR2 to the agent) in the middle of an
epoch and resumed by a second agent of the same run ends with parameters bitwise equal to
an uninterrupted run: the mid-epoch sample offset, the optimizer/StepLR state and the RNG
states all come back from the shared checkpoint directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from slurm_elastic.agent import ExitCode
from slurm_elastic.events import read_events
from slurm_elastic.submit import processes
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_imagenet_style.py"
# 8 steps per epoch; StepLR decays after 2 epochs (step 16), inside the run.
TRAIN_ARGS = [
    "--steps", "20", "--dataset-size", "128", "--global-batch", "16", "--image-size", "12",
    "--width", "8", "--val-size", "32", "--lr-step-epochs", "2", "--print-freq", "4",
]  # fmt: skip
STEPS_PER_EPOCH = 8


class Agent:
    """``slurm-elastic agent`` running the example: one node, two workers."""

    def __init__(self, tmp: Path, run_id: str, name: str, *extra: str) -> None:
        self.log_path = tmp / f"{name}.log"
        argv = [
            sys.executable, "-m", "slurm_elastic.cli.main", "agent",
            "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-id", run_id,
            "--state-dir", str(tmp / "state"), "--local-addr", "127.0.0.1",
            "--monitor-interval", "0.1", "--max-restarts", "0",
            str(EXAMPLE), *TRAIN_ARGS, *extra,
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        env["OMP_NUM_THREADS"] = "1"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@pytest.fixture
def started(tmp_path: Path) -> Any:
    agents: list[Agent] = []
    yield agents
    # agents and their workers (own sessions), by process id
    processes.stop_tree([a.proc for a in agents], 5, first_signal=signal.SIGKILL)


def saved_steps(state: Path, run_id: str) -> list[int]:
    directory = state / "events" / run_id
    if not directory.exists():
        return []
    return [e["step"] for e in read_events(directory) if e["kind"] == "checkpoint.saved"]


def params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def test_preempted_mid_epoch_then_resumed_equals_uninterrupted_run_bitwise(
    tmp_path: Path, started: list[Agent]
) -> None:
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "interrupted"
    ref_dir.mkdir()
    run_dir.mkdir()

    # The uninterrupted run goes on beside the first part of the interrupted one.
    reference = Agent(ref_dir, "img-ref", "agent", "--out", str(ref_dir / "params.pt"))
    first = Agent(run_dir, "img", "agent1", "--step-time", "0.3")
    started += [reference, first]
    # The epoch-end checkpoint of epoch 0 is committed; the notice lands a step or two later.
    wait_for(
        lambda: STEPS_PER_EPOCH in saved_steps(run_dir / "state", "img"),
        90,
        "the end-of-epoch checkpoint at step 8",
    )
    os.kill(first.proc.pid, signal.SIGUSR2)
    assert first.wait(60) == ExitCode.PREEMPTED, first.log()  # outside Slurm: no requeue
    preempt_step = max(saved_steps(run_dir / "state", "img"))
    assert STEPS_PER_EPOCH < preempt_step < 2 * STEPS_PER_EPOCH, (preempt_step, first.log())
    assert not (run_dir / "params.pt").exists()

    assert reference.wait(120) == ExitCode.FINISHED, reference.log()
    second = Agent(run_dir, "img", "agent2", "--out", str(run_dir / "params.pt"))
    started.append(second)
    assert second.wait(120) == ExitCode.FINISHED, second.log()
    offset = (preempt_step - STEPS_PER_EPOCH) * 16
    assert f"resumed at step {preempt_step} (epoch 1, offset {offset}); world 2 -> 2" in (
        second.log()
    )

    ref, got = params(ref_dir / "params.pt"), params(run_dir / "params.pt")
    assert ref.keys() == got.keys()
    unequal = [k for k in ref if not torch.equal(ref[k], got[k])]
    assert not unequal, f"parameters differ from the uninterrupted run: {unequal}"
