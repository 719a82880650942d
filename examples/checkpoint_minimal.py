"""The few lines a train.py adopts for exact, elastic, preemption-safe resume.

Run it alone (``python examples/checkpoint_minimal.py``), under ``torchrun``, or under the
slurm_elastic agent (which sets ``SLURM_ELASTIC_CHECKPOINT_DIR`` and the preemption notice).
Run it twice: the second run resumes where the first stopped, with any world size.
Lines marked ``# <--`` are the slurm_elastic part.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from slurm_elastic.checkpoint import (  # <--
    CheckpointManager,
    ElasticSampler,
    loss_scale,
    micro_batches,
    plan_batches,
    restore_training_state,
    training_state,
)
from slurm_elastic.notice import preemption_requested, report_progress  # <--

GLOBAL_BATCH, TOTAL_STEPS, SAVE_EVERY = 32, 200, 50


def main() -> None:
    torch.set_num_threads(1)
    if "RANK" in os.environ:  # started by torchrun / the agent
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    x = torch.randn(1000, 16, generator=torch.Generator().manual_seed(0))
    y = x.sum(dim=1, keepdim=True)

    torch.manual_seed(0)
    net = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, TOTAL_STEPS)

    ckpt = CheckpointManager.from_env(default="checkpoints", keep_last=3)  # <--
    step, epoch, offset = 0, 0, 0
    loaded = ckpt.load_latest()  # <-- newest complete + verified; None on the first run
    if loaded is not None:
        info = restore_training_state(loaded.state, net, opt, sched, source=loaded.path)  # <--
        step, epoch, offset = info.step, info.epoch, info.sample_offset
    model = torch.nn.parallel.DistributedDataParallel(net) if world > 1 else net

    plan = plan_batches(world, global_batch_size=GLOBAL_BATCH, max_micro_batch=16)  # <--
    sampler = ElasticSampler(len(x), plan.global_batch_size, seed=1)  # <--

    def save(blocking: bool) -> None:  # <-- collective: every rank calls it
        state = training_state(
            model,
            opt,
            sched,
            step=step,
            epoch=epoch,
            sample_offset=offset,
            global_batch_size=plan.global_batch_size,
        )
        ckpt.save(state, step, blocking=blocking)

    while step < TOTAL_STEPS:
        sampler.set_epoch(epoch, offset)  # <--
        for sl in sampler.slices():  # <-- this rank's share of one global batch
            opt.zero_grad()
            for chunk in micro_batches(sl.indices, plan.accumulation_steps):  # <--
                idx = torch.as_tensor(chunk, dtype=torch.long)
                loss = ((model(x[idx]) - y[idx]) ** 2).sum() * loss_scale(sl.global_size, world)
                loss.backward()
            opt.step()
            sched.step()
            step, offset = step + 1, sl.stop  # <-- sample offset = what was consumed
            if offset >= sampler.epoch_length:
                epoch, offset = epoch + 1, 0
            report_progress(step)  # <-- hang watchdog heartbeat (no-op outside the agent)
            if preemption_requested():  # <-- flag set by the agent's signal/notice
                save(blocking=True)
                return  # exit; the agent requeues and a later run resumes here
            if step % SAVE_EVERY == 0 or step == TOTAL_STEPS:
                save(blocking=False)  # <-- blocks only while copying to host memory
            if step >= TOTAL_STEPS:
                break
    ckpt.close()  # <-- waits for the last save
    if rank == 0:
        print(f"done: step {step}, world size {world}")


if __name__ == "__main__":
    main()
