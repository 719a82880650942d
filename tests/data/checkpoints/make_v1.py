"""Writes the golden checkpoints under ``v1/`` (kept in the repository, never rewritten).

Run once with the code of commit 1f167ef (2026-12-03), before the training state got
its own package: ``python tests/data/checkpoints/make_v1.py OUT``. The tests load what it
wrote with today's code (tests/training/test_old_checkpoints.py); ``expected.json`` holds
the sums of every tensor as saved, so the check needs neither the old code nor torch's
bitwise reproducibility across versions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from slurm_elastic.checkpoint import CheckpointManager, training_state


def build() -> tuple[nn.Module, torch.optim.Optimizer, object, dict[str, object]]:
    """The model, optimizer, scheduler and stateful objects of the golden run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    head = nn.Linear(2, 1)
    second = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    return model, opt, sched, {"head": head, "second": second}


def sums(tree: object, prefix: str = "") -> dict[str, float]:
    """Every tensor's float64 sum, by its path in the tree."""
    out: dict[str, float] = {}
    if isinstance(tree, torch.Tensor):
        out[prefix] = float(tree.detach().double().sum())
    elif isinstance(tree, dict):
        for key, value in tree.items():
            out.update(sums(value, f"{prefix}/{key}"))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            out.update(sums(value, f"{prefix}/{i}"))
    return out


def main(out: Path) -> None:
    model, opt, sched, stateful = build()
    head, second = stateful["head"], stateful["second"]
    for _ in range(3):
        opt.zero_grad()
        second.zero_grad()
        head(model(torch.randn(8, 4))).square().mean().backward()
        opt.step()
        second.step()
        sched.step()
    bundle = training_state(
        model, opt, sched, step=3, epoch=1, sample_offset=24, global_batch_size=8,
        extra={"note": "v1"}, stateful=stateful,
    )  # fmt: skip
    CheckpointManager(out / "ckpt", run_id="").save(bundle, 3)
    (out / "expected.json").write_text(json.dumps(sums(bundle), indent=1, sort_keys=True))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
