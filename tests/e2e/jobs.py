"""Helpers for end-to-end tests: render + submit the real templates, read what happened."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from slurm_elastic.events import read_events
from slurm_elastic.submit.render import render_template
from tests.helpers import read_jsonl

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


def job_values(tmp: Path, mode: str, train_args: list[str], **values: Any) -> dict[str, Any]:
    (tmp / "logs").mkdir(exist_ok=True)
    return {
        "entrypoint": str(TRAIN),
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
    """Samples that made it into the final model, per epoch.

    Steps done by a group of workers that was stopped before its next checkpoint are
    done again by the next group; the later attempt of a step is the one that counts.
    ``so_far``: while the run trains, only the steps up to the newest record's step
    count (an older attempt's steps beyond it are still to be redone by the current one).
    """
    by_step: dict[tuple[int, int], dict[str, list[dict[str, Any]]]] = defaultdict(dict)
    records = read_jsonl(path)
    for rec in records:
        by_step[(rec["epoch"], rec["step"])].setdefault(rec["attempt"], []).append(rec)
    newest = max(records, key=lambda r: r["time"], default=None)
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for (epoch, step), attempts in sorted(by_step.items()):
        if so_far and newest is not None and (epoch, step) > (newest["epoch"], newest["step"]):
            continue
        last = max(attempts.values(), key=lambda recs: max(r["time"] for r in recs))
        for rec in last:
            per_epoch[epoch].extend(rec["indices"])
    return per_epoch


def assert_each_sample_once_per_full_epoch(ledger: dict[int, list[int]], n: int) -> None:
    for epoch, seen in ledger.items():
        assert len(seen) == len(set(seen)), f"epoch {epoch}: a sample was used twice"
        if epoch < max(ledger):
            assert sorted(seen) == list(range(n)), f"epoch {epoch}: samples missing"


def max_abs_diff(a: Path, b: Path) -> float:
    pa, pb = torch.load(a), torch.load(b)
    assert pa.keys() == pb.keys()
    return max(float((pa[k] - pb[k]).abs().max()) for k in pa)
