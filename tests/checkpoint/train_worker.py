"""One rank of a tiny deterministic DDP training job (run as a script, not collected).

Used by test_exactness.py: trains from the newest checkpoint in ``--ckpt`` (or from scratch)
up to ``--stop-step``, checkpoints there, and records every consumed sample index in a
ledger file. Real gloo process group over a FileStore, real DDP, real CheckpointManager,
ElasticSampler, world-size policy and training-state bundle.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from slurm_elastic.checkpoint import (
    CheckpointManager,
    ElasticSampler,
    loss_scale,
    micro_batches,
    plan_batches,
    restore_training_state,
    training_state,
)

N_SAMPLES = 50
DIM = 8


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, DIM, generator=gen)
    y = (x @ torch.randn(DIM, 1, generator=gen)).tanh() + 0.1 * torch.randn(
        N_SAMPLES, 1, generator=gen
    )
    return x, y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--init-file", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--ledger", required=True)
    ap.add_argument("--stop-step", type=int, required=True)
    ap.add_argument("--mode", default="fixed_global")
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--local-batch", type=int, default=6)
    ap.add_argument("--max-micro", type=int, default=4)
    ap.add_argument("--out", default="")
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.1)
    args = ap.parse_args()
    # A hang shows where: every thread's stack, then exit (before the test's 300 s).
    faulthandler.dump_traceback_later(240, exit=True)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=f"file://{args.init_file}", rank=rank, world_size=world
    )

    torch.manual_seed(0)  # identical initial parameters on every rank and every run
    net = torch.nn.Sequential(
        torch.nn.Linear(DIM, 16),
        torch.nn.Tanh(),
        torch.nn.Dropout(args.dropout),
        torch.nn.Linear(16, 1),
    )
    torch.manual_seed(100 + rank)  # per-rank dropout streams
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    manager = CheckpointManager(args.ckpt, keep_last=2)

    step, epoch, offset = 0, 0, 0
    loaded = manager.load_latest()
    if loaded is not None:
        info = restore_training_state(loaded.state, net, opt, sched, source=loaded.path)
        step, epoch, offset = info.step, info.epoch, info.sample_offset
    model = DDP(net)

    plan = plan_batches(
        world,
        global_batch_size=args.global_batch,
        local_batch_size=args.local_batch,
        max_micro_batch=args.max_micro,
        mode=args.mode,
    )
    sampler = ElasticSampler(N_SAMPLES, plan.global_batch_size, rank=rank, world_size=world, seed=7)
    x, y = dataset()
    ledger = open(Path(args.ledger) / f"w{world}-r{rank}-{os.getpid()}.jsonl", "a")  # noqa: SIM115

    while step < args.stop_step:
        sampler.set_epoch(epoch, offset)
        for sl in sampler.slices():
            ledger.write(json.dumps({"epoch": epoch, "step": step, "indices": sl.indices}) + "\n")
            opt.zero_grad(set_to_none=False)
            scale = loss_scale(sl.global_size, world)
            for chunk in micro_batches(sl.indices, plan.accumulation_steps):
                idx = torch.tensor(chunk, dtype=torch.long)
                loss = ((model(x[idx]) - y[idx]) ** 2).sum() * scale
                loss.backward()
            opt.step()
            sched.step()
            step, offset = step + 1, sl.stop
            if offset >= sampler.epoch_length:
                epoch, offset = epoch + 1, 0
            bundle_args = dict(
                step=step,
                epoch=epoch,
                sample_offset=offset,
                global_batch_size=plan.global_batch_size,
            )
            if step == args.stop_step:
                manager.save(training_state(model, opt, sched, **bundle_args), step, blocking=False)
                break
            if step % args.save_every == 0:  # async: training goes on while it writes
                manager.save(training_state(model, opt, sched, **bundle_args), step, blocking=False)
    manager.close()
    ledger.close()
    if rank == 0 and args.out:
        torch.save({k: v.clone() for k, v in net.state_dict().items()}, args.out)
    dist.barrier()
    # DDP goes before its process group (torch's order). With DDP still alive here, a
    # rank hung about 1 run in 8 under load, after main() returned (faulthandler: the
    # main thread at the call of main(), so in the destructors of its locals).
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
