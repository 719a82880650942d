"""Reference ``train.py`` for slurm_elastic: deterministic DDP on synthetic data, CPU-able.

Run it under the agent (one per node), e.g. on your machine::

    slurm-elastic agent --nnodes 1:2 --nproc-per-node 2 --rdzv-id demo \\
        examples/train_ddp.py --steps 200

What it shows: a plain DDP step function handed to ``slurm_elastic.live.ElasticLoop``,
which owns everything elastic around it:

1. membership changes **in place**: a node that joins, leaves with notice or dies does not
   restart the other workers; they re-form the process group at a step boundary and a
   newcomer gets the state from a survivor (``SLURM_ELASTIC_IN_PLACE=0``: the restart path);
2. resume from the newest *verified* checkpoint when nobody has live state, whatever the
   world size was;
3. a data order that survives world-size changes (each sample once per epoch) with the
   global batch fixed (``step.loss_scale``);
4. progress reports for the agent's hang watchdog, the preemption notice (everyone saves
   together when the whole job stops), async checkpoints every ``--save-every`` steps.

It is deterministic: the same seed and the same world size give bitwise equal parameters,
interrupted or not (``--out`` writes them at the end; ``--ledger`` logs every sample).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

from slurm_elastic import ledger, notice
from slurm_elastic.checkpoint import CheckpointManager
from slurm_elastic.live import ElasticLoop, Step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in total")
    p.add_argument("--dataset-size", type=int, default=1000)
    p.add_argument("--global-batch", type=int, default=32, help="samples per step, all ranks")
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument(
        "--depth",
        type=int,
        default=0,
        help="apply one more hidden layer this many times (shared weights): compute per "
        "sample grows, gradients do not (benchmarks use it for compute-bound steps)",
    )
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    p.add_argument(
        "--pace-until-world",
        type=int,
        default=0,
        help="with --step-time: pause only while the world has fewer ranks than this "
        "(a test's member trains slowly until newcomers have joined, then at full speed)",
    )
    p.add_argument(
        "--pace-until-file",
        default=None,
        help="with --step-time: pause only until this file exists (a test creates it once "
        "what it waits for has happened: then the training runs at full speed)",
    )
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="default: $SLURM_ELASTIC_CHECKPOINT_DIR (set by the agent)",
    )
    p.add_argument("--out", default=None, help="rank 0 writes the final parameters here")
    p.add_argument("--ledger", default=None, help="append consumed sample indices (JSONL)")
    p.add_argument(
        "--leave-wait",
        type=float,
        default=60.0,
        help="a leave waits this long for the survivors' new round, then everyone saves",
    )
    p.add_argument(
        "--commit-every",
        type=int,
        default=0,
        help="host copy of the state every N steps (0: none; survivors share their live state)",
    )
    p.add_argument(
        "--async-commit",
        action="store_true",
        help="copy commits on a thread while the next step runs (ElasticLoop async_commit)",
    )
    p.add_argument(
        "--vote-interval",
        type=float,
        default=0.25,
        help="seconds of training between the ranks' membership votes (0: every step)",
    )
    p.add_argument(
        "--reform-timeout",
        type=float,
        default=120.0,
        help="after a peer failure, wait this long for a new round, then restart",
    )
    return p.parse_args(argv)


def synthetic_data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.dataset_size, args.features, generator=gen)
    w = torch.randn(args.features, 1, generator=gen)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(args.dataset_size, 1, generator=gen)
    return x, y


class Repeated(nn.Module):
    """One ``Linear(hidden, hidden)`` + tanh applied ``times`` times (one set of weights)."""

    def __init__(self, hidden: int, times: int) -> None:
        super().__init__()
        self.layer, self.times = nn.Linear(hidden, hidden), times

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for _ in range(self.times):
            h = torch.tanh(self.layer(h))
        return h


def build_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(args.seed)
    head = [nn.Linear(args.features, args.hidden), nn.Tanh()]
    if getattr(args, "depth", 0):
        head.append(Repeated(args.hidden, args.depth))
    return nn.Sequential(*head, nn.Linear(args.hidden, 1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    notice.install_preemption_handler()
    x, y = synthetic_data(args)
    net = build_model(args)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
    loop = ElasticLoop(
        net, opt, sched,
        dataset_size=args.dataset_size, global_batch_size=args.global_batch, seed=args.seed,
        checkpoint=CheckpointManager.from_env(args.checkpoint_dir, keep_last=3),
        save_every=args.save_every, leave_wait_s=args.leave_wait,
        commit_every=args.commit_every, reform_timeout_s=args.reform_timeout,
        async_commit=args.async_commit, vote_interval_s=args.vote_interval,
    )  # fmt: skip

    def train_step(s: Step) -> None:
        if args.ledger:  # at the start: an attempt that fails is superseded by its redo
            ledger.append(args.ledger, epoch=s.epoch, step=s.step + 1, rank=s.rank,
                          world=s.world_size, indices=s.indices, attempt=f"round{s.round}",
                          round=s.round, pid=os.getpid())  # fmt: skip
        loss = ((s.model(x[s.indices]) - y[s.indices]) ** 2).sum() * s.loss_scale
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        sched.step()
        if s.rank == 0 and (s.step + 1) % 10 == 0:
            print(f"step {s.step + 1} loss {loss.item():.5f} world {s.world_size}", flush=True)
        grown = args.pace_until_world and s.world_size >= args.pace_until_world
        released = args.pace_until_file and os.path.exists(args.pace_until_file)
        if args.step_time and not grown and not released:
            time.sleep(args.step_time)

    loop.start()
    if loop.rank == 0 and loop.resume_world_size is not None:
        print(
            f"resumed at step {loop.step} (epoch {loop.epoch}, offset {loop.sample_offset}); "
            f"world {loop.resume_world_size} -> {loop.world_size}",
            flush=True,
        )
    outcome = loop.run(train_step, steps=args.steps)
    if outcome == "done" and loop.rank == 0 and args.out:
        params = {k: v.detach().clone() for k, v in net.state_dict().items()}
        torch.save(params, f"{args.out}.tmp")
        os.replace(f"{args.out}.tmp", args.out)
    loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
