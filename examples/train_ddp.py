"""Reference ``train.py`` for slurm_elastic: deterministic DDP on synthetic data, CPU-able.

Run it under the agent (one per node), e.g. on your machine::

    slurm-elastic agent --nnodes 1:2 --nproc-per-node 2 --rdzv-id demo \\
        examples/train_ddp.py --steps 200

What it shows, in the order a real ``train.py`` needs it:

1. resume from the newest *verified* checkpoint, whatever the world size was
   (``CheckpointManager.load_latest`` + ``restore_training_state``);
2. a data order that survives world-size changes (``ElasticSampler`` resumed at the
   saved global sample offset) with the global batch fixed (``loss_scale``);
3. progress reports for the agent's hang watchdog (``notice.report_progress``);
4. the preemption notice: every step the ranks agree (one tiny all_reduce) whether any
   node was told to stop; then all save one checkpoint together, the ranks of the
   stopping node exit, and the others wait for the agent to start the next round;
5. async checkpoints every ``--save-every`` steps (the loop only waits for the copy).

It is deterministic: the same seed and the same world size give bitwise equal parameters,
interrupted or not (``--out`` writes them at the end; ``--ledger`` logs every sample).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from slurm_elastic import events, notice
from slurm_elastic.checkpoint import (
    CheckpointManager,
    ElasticSampler,
    loss_scale,
    restore_training_state,
    training_state,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in total")
    p.add_argument("--dataset-size", type=int, default=1000)
    p.add_argument("--global-batch", type=int, default=32, help="samples per step, all ranks")
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
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
        help="after a peer's preemption save, wait this long for the new round",
    )
    return p.parse_args(argv)


def synthetic_data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.dataset_size, args.features, generator=gen)
    w = torch.randn(args.features, 1, generator=gen)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(args.dataset_size, 1, generator=gen)
    return x, y


def build_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(args.seed)
    return nn.Sequential(
        nn.Linear(args.features, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1)
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    notice.install_preemption_handler()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # one id per group of workers (each round gets a fresh store); only for the ledger
    attempt = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"

    x, y = synthetic_data(args)
    model = DistributedDataParallel(build_model(args))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
    ckpt = CheckpointManager.from_env(args.checkpoint_dir, keep_last=3)

    step, epoch, offset = 0, 0, 0
    loaded = ckpt.load_latest()
    if loaded is not None:
        info = restore_training_state(loaded.state, model, opt, sched, source=loaded.path)
        step, epoch, offset = info.step, info.epoch, info.sample_offset
        del loaded
        if rank == 0:
            print(
                f"resumed at step {step} (epoch {epoch}, offset {offset}); world "
                f"{info.saved_world_size} -> {world}",
                flush=True,
            )
    sampler = ElasticSampler(args.dataset_size, args.global_batch, seed=args.seed)
    sampler.set_epoch(epoch, offset)
    events.emit(events.TrainStart(step=step, world_size=world, rank=rank, total_steps=args.steps))

    saved = [step]

    def save(blocking: bool) -> None:
        if saved[0] == step:
            ckpt.flush()
            return
        state = training_state(
            model,
            opt,
            sched,
            step=step,
            epoch=epoch,
            sample_offset=offset,
            global_batch_size=args.global_batch,
        )
        ckpt.save(state, step, blocking=blocking)
        saved[0] = step

    while step < args.steps:
        for piece in sampler.slices():
            xb, yb = x[piece.indices], y[piece.indices]
            loss = ((model(xb) - yb) ** 2).sum() * loss_scale(piece.global_size, world)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            sched.step()
            step, offset = step + 1, piece.stop
            if args.ledger:
                with open(args.ledger, "a") as fh:
                    fh.write(
                        json.dumps(
                            {
                                "epoch": epoch,
                                "step": step,
                                "rank": rank,
                                "world": world,
                                "indices": piece.indices,
                                "attempt": attempt,
                                "time": time.time(),
                            }
                        )
                        + "\n"
                    )
            notice.report_progress(step)
            if rank == 0 and step % 10 == 0:
                print(f"step {step} loss {loss.item():.5f} world {world}", flush=True)
                events.emit(  # for slurm-elastic status/timeline: throughput, progress
                    events.TrainProgress(
                        step=step,
                        rank=rank,
                        total_steps=args.steps,
                        samples=step * args.global_batch,
                    )
                )
            if args.step_time:
                time.sleep(args.step_time)

            anyone_stopping, stopping_here = notice.preemption_agreed()
            if anyone_stopping:
                save(blocking=True)  # together, now: nothing finished is lost
                # This node stops; or a peer's node does, and our agent will stop these
                # workers for the next round (they resume from the checkpoint just saved).
                if stopping_here or notice.await_new_round(args.leave_wait):
                    events.emit(events.TrainPreempted(step=step, rank=rank))
                    return 0
            elif step % args.save_every == 0:
                save(blocking=False)
            if step >= args.steps:
                break
        else:
            epoch, offset = epoch + 1, 0
            sampler.set_epoch(epoch, 0)

    save(blocking=True)
    if rank == 0 and args.out:
        params = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        tmp = f"{args.out}.tmp"
        torch.save(params, tmp)
        os.replace(tmp, args.out)
    events.emit(events.TrainDone(step=step, rank=rank))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
