"""Helpers for end-to-end tests: render + submit the real templates, read what happened."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from slurm_elastic import ledger
from slurm_elastic.events import read_events
from slurm_elastic.submit.render import render_template

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train_ddp.py"

# Fast failure detection and short grace periods: the local cluster is one 2-core VM.
FAST = {
    "heartbeat_interval_s": 0.5,
    "heartbeat_miss_limit": 4,
    "last_call_timeout_s": 2,
    "monitor_interval_s": 0.2,
    "shutdown_timeout_s": 30,
    "join_timeout_s": 300,
}


def job_values(
    tmp: Path, mode: str, train_args: list[str], *, script: Path = TRAIN, **values: Any
) -> dict[str, Any]:
    (tmp / "logs").mkdir(exist_ok=True)
    return {
        "entrypoint": str(script),
        "args": train_args,
        "launcher": f"{sys.executable} -m slurm_elastic.cli.main",
        "output_dir": str(tmp / "logs"),
        "state_dir": str(tmp / "state"),
        "setup": "export OMP_NUM_THREADS=1",
        "job_name": f"e2e-{mode}",
        **FAST,
        **values,
    }


def render(mode: str, values: dict[str, Any]) -> str:
    return render_template(mode, {"mode": mode, **values})


def agent_events(state: Path, run_id: str) -> list[dict[str, Any]]:
    directory = state / "events" / run_id
    return list(read_events(directory)) if directory.exists() else []


def rounds(state: Path, run_id: str, since: float = 0.0) -> list[dict[str, Any]]:
    """Round events (one per node per round) after ``since``: workers (re)started, or
    the round formed in place around running workers."""
    kinds = ("agent.workers_started", "agent.reformed_in_place")
    return [e for e in agent_events(state, run_id) if e["kind"] in kinds and e["time"] >= since]


def effective_ledger(path: Path, *, so_far: bool = False) -> dict[int, list[int]]:
    """Samples that made it into the final model, per epoch (``slurm_elastic.ledger``:
    the later attempt of a step is the one that counts; ``so_far`` for a run that still
    trains)."""
    return ledger.samples_per_epoch(ledger.read(path), so_far=so_far)


def assert_ledger_ok(path: Path, n: int, *, so_far: bool = False) -> None:
    """Each sample once per epoch, every step run by every rank of its world once (the
    one checker, ``slurm_elastic.ledger.check``)."""
    problems = ledger.check(ledger.read(path), n, so_far=so_far)
    assert not problems, f"{path}: {problems}"


def assert_close_params(a: Path, b: Path, *, rtol: float, atol: float) -> None:
    """The parameters (and any other tensors saved) of ``a`` equal ``b``'s within tolerance."""
    pa, pb = torch.load(a), torch.load(b)
    assert pa.keys() == pb.keys()
    for key in pa:
        torch.testing.assert_close(pa[key], pb[key], rtol=rtol, atol=atol, msg=key)


def max_abs_diff(a: Path, b: Path) -> float:
    pa, pb = torch.load(a), torch.load(b)
    assert pa.keys() == pb.keys()
    return max(float((pa[k] - pb[k]).abs().max()) for k in pa)
