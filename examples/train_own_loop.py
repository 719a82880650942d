"""Your own training loop, elastic: a DataLoader, a GradScaler, two optimizers and an EMA.

What it shows: ``slurm_elastic.live.ElasticSession`` around a plain loop: the user keeps
``for batch in loader:`` and marks each optimizer step with ``with session.step():``;
membership changes (a node joins, leaves with notice, or dies) happen in place at step
boundaries, every registered object (both optimizers, the scheduler, the scaler, the EMA)
is committed, shared with newcomers and checkpointed, and every sample is used once per
epoch. The same flags and ledger rows as ``examples/train_ddp.py``, so the same tests and
benches run it::

    slurm-elastic agent --nnodes 1:4 --nproc-per-node 2 examples/train_own_loop.py --steps 200

:func:`reference` is the uninterrupted math in one process (the tests compare with it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from slurm_elastic import ledger, notice
from slurm_elastic.checkpoint import CheckpointManager, ElasticSampler, loss_scale
from slurm_elastic.live import ElasticSession


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in total")
    p.add_argument("--dataset-size", type=int, default=1000)
    p.add_argument("--global-batch", type=int, default=32, help="samples per step, all ranks")
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    p.add_argument(
        "--pace-until-file",
        default=None,
        help="with --step-time: pause only until this file exists (a test creates it once "
        "what it waits for has happened: then the training runs at full speed)",
    )
    p.add_argument("--num-workers", type=int, default=1, help="DataLoader worker processes")
    p.add_argument(
        "--plain-loader",
        action="store_true",
        help="no worker_init_fn (the README's loop): forked workers rely on the session",
    )
    p.add_argument("--checkpoint-dir", default=None, help="default: $SLURM_ELASTIC_CHECKPOINT_DIR")
    p.add_argument("--out", default=None, help="rank 0 writes the final parameters here")
    p.add_argument("--ledger", default=None, help="append consumed sample indices (JSONL)")
    p.add_argument("--leave-wait", type=float, default=60.0)
    p.add_argument("--reform-timeout", type=float, default=120.0)
    return p.parse_args(argv)


class Synthetic(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """A map-style dataset: ``(x, y, index)``."""

    def __init__(self, args: argparse.Namespace) -> None:
        gen = torch.Generator().manual_seed(args.seed)
        self.x = torch.randn(args.dataset_size, args.features, generator=gen)
        w = torch.randn(args.features, 1, generator=gen)
        self.y = torch.tanh(self.x @ w) + 0.1 * torch.randn(args.dataset_size, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def collate(items: list[tuple[torch.Tensor, torch.Tensor, int]]) -> dict[str, Any]:
    """Stack a batch; an empty one (a rank's share at an epoch tail) stays empty."""
    if not items:
        return {"x": torch.zeros(0, 0), "y": torch.zeros(0, 1), "index": []}
    xs, ys, idx = zip(*items, strict=True)
    return {"x": torch.stack(xs), "y": torch.stack(ys), "index": list(idx)}


class Training:
    """The model, two optimizers (one per layer), a scheduler, a scaler and an EMA."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(args.seed)
        self.features = args.features
        self.net = nn.Sequential(
            nn.Linear(args.features, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1)
        )
        self.opt_body = torch.optim.SGD(self.net[0].parameters(), lr=0.05, momentum=0.9)
        self.opt_head = torch.optim.Adam(self.net[2].parameters(), lr=0.01)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt_body, step_size=100, gamma=0.5)
        # On CPU the scaler runs its real unscale/inf-check/update path (float32 grads).
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=50)
        self.ema = torch.optim.swa_utils.AveragedModel(
            self.net, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
        )

    def step(self, model: nn.Module, batch: dict[str, Any], scale: float) -> torch.Tensor:
        x, y = batch["x"], batch["y"]
        if len(batch["index"]) == 0:  # no samples here: still take part in the step
            x = torch.zeros(0, self.features)
        out = model(x)
        loss = ((out - y) ** 2).sum() * scale
        self.opt_body.zero_grad(set_to_none=False)
        self.opt_head.zero_grad(set_to_none=False)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt_body)
        self.scaler.step(self.opt_head)
        self.scaler.update()
        self.sched.step()
        self.ema.update_parameters(self.net)
        return loss


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    data = Synthetic(args)
    t = Training(args)
    session = ElasticSession(
        t.net, t.opt_body, t.sched,
        stateful={"opt_head": t.opt_head, "scaler": t.scaler, "ema": t.ema},
        dataset_size=len(data), global_batch_size=args.global_batch, seed=args.seed,
        checkpoint=CheckpointManager.from_env(args.checkpoint_dir, keep_last=3),
        save_every=args.save_every, leave_wait_s=args.leave_wait,
        reform_timeout_s=args.reform_timeout,
    )  # fmt: skip
    while not session.finished(steps=args.steps):
        # The notice reaches the loader's workers too when Slurm signals every process
        # of the step: forked workers inherit the session's handler (the README's
        # shape, --plain-loader); loader_worker_init makes every loader worker ignore
        # it, also those of a spawn/forkserver loader, which inherit no handler.
        init = None if args.plain_loader else notice.loader_worker_init
        loader = DataLoader(
            data, batch_sampler=session.batches(), collate_fn=collate,
            num_workers=args.num_workers, worker_init_fn=init,
        )  # fmt: skip
        for batch in loader:
            with session.step() as s:
                if batch["index"] != s.indices:  # the loader and the step agree
                    raise RuntimeError(f"loader gave {batch['index']}, step wants {s.indices}")
                if args.ledger:  # at the start: a failed attempt is superseded by its redo
                    ledger.append(args.ledger, epoch=s.epoch, step=s.step + 1, rank=s.rank,
                                  world=s.world_size, indices=s.indices,
                                  attempt=f"round{s.round}", round=s.round,
                                  pid=os.getpid())  # fmt: skip
                loss = t.step(session.model, batch, s.loss_scale)
                if s.rank == 0 and (s.step + 1) % 10 == 0:
                    print(f"step {s.step + 1} loss {loss.item():.5f} world {s.world_size}",
                          flush=True)  # fmt: skip
                released = args.pace_until_file and os.path.exists(args.pace_until_file)
                if args.step_time and not released:
                    time.sleep(args.step_time)
            if session.interrupted or session.reached(steps=args.steps):
                break
    outcome = session.finish()
    if outcome == "done" and session.rank == 0 and args.out:
        params = {k: v.detach().clone() for k, v in t.net.state_dict().items()}
        params.update({f"ema.{k}": v.detach().clone() for k, v in t.ema.state_dict().items()})
        params["scaler.scale"] = torch.tensor(t.scaler.get_scale())
        torch.save(params, f"{args.out}.tmp")
        os.replace(f"{args.out}.tmp", args.out)
    session.close()
    return 0


def reference(argv: list[str]) -> dict[str, torch.Tensor]:
    """The uninterrupted run's math in this process (one rank, the same global batches)."""
    args = parse_args(argv)
    data, t = Synthetic(args), Training(args)
    sampler = ElasticSampler(len(data), args.global_batch, rank=0, world_size=1, seed=args.seed)
    done, epoch = 0, 0
    while done < args.steps:
        sampler.set_epoch(epoch, 0)
        for piece in sampler.slices():
            batch = collate([data[i] for i in piece.indices])
            t.step(t.net, batch, loss_scale(piece.global_size, 1))
            done += 1
            if done >= args.steps:
                break
        epoch += 1
    params = {k: v.detach().clone() for k, v in t.net.state_dict().items()}
    params.update({f"ema.{k}": v.detach().clone() for k, v in t.ema.state_dict().items()})
    params["scaler.scale"] = torch.tensor(t.scaler.get_scale())
    return params


if __name__ == "__main__":
    sys.exit(main())
