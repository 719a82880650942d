"""The baseline of ``bench/goodput.py``: whole-job requeue with submitit's ``Checkpointable``.

This is what users do today: a plain DDP script in one multi-node Slurm job, submitted
with submitit; it saves a checkpoint every ``save_every`` steps, and its ``checkpoint()``
is submitit's default (resubmit the same callable, which resumes from the newest saved
checkpoint). On a preemption notice (USR2) submitit's handler on rank 0 requeues the
whole job; the steps since the last save are done again after the restart.

The model, data and optimizer are those of ``examples/train_ddp.py`` (same step cost: compute-bound, no pacing);
the ledger has the same records (``attempt``/``round`` = the Slurm restart count), so
``bench/goodput.py`` counts useful steps of both the same way.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import submitit

REPO = Path(__file__).resolve().parents[1]


class RequeueTrainer(submitit.helpers.Checkpointable):
    """A DDP training run that survives preemption by whole-job requeue.

    Args:
        opts: ``steps``, ``dataset_size``, ``global_batch``, ``save_every``,
            ``hidden``, ``depth``, ``ledger`` (path), ``checkpoint`` (path), ``seed``.
    """

    def __init__(self, opts: dict[str, Any]) -> None:
        self.opts = dict(opts)

    def __call__(self) -> int:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        sys.path.insert(0, str(REPO / "examples"))
        import train_ddp

        from slurm_elastic import ledger
        from slurm_elastic.training.sampler import rank_share

        o = self.opts
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        submitit.helpers.TorchDistributedEnvironment().export()
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        args = train_ddp.parse_args([
            "--dataset-size", str(o["dataset_size"]), "--global-batch", str(o["global_batch"]),
            "--hidden", str(o["hidden"]), "--depth", str(o["depth"]),
        ])  # fmt: skip
        x, y = train_ddp.synthetic_data(args)
        net = train_ddp.build_model(args)
        opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
        ckpt = Path(o["checkpoint"])
        step = 0
        if ckpt.exists():
            saved = torch.load(ckpt, weights_only=False)
            net.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
            sched.load_state_dict(saved["scheduler"])
            step = int(saved["step"])
        model = DistributedDataParallel(net)
        restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        per_epoch = -(-args.dataset_size // args.global_batch)
        while step < o["steps"]:
            epoch, k = divmod(step, per_epoch)
            gen = torch.Generator().manual_seed(args.seed + epoch)
            order = torch.randperm(args.dataset_size, generator=gen).tolist()
            start = k * args.global_batch
            stop = min(start + args.global_batch, args.dataset_size)
            lo, hi = rank_share(start, stop, rank, world)
            idx = order[lo:hi]
            loss = ((model(x[idx]) - y[idx]) ** 2).sum() * (world / (stop - start))
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            ledger.append(o["ledger"], epoch=epoch, step=step, rank=rank, world=world,
                          indices=idx, attempt=f"restart{restart}", round=restart,
                          pid=os.getpid())  # fmt: skip
            if rank == 0 and step % o["save_every"] == 0:
                state = {
                    "model": net.state_dict(),
                    "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(),
                    "step": step,
                }
                torch.save(state, f"{ckpt}.tmp")
                os.replace(f"{ckpt}.tmp", ckpt)
        dist.destroy_process_group()
        return step
