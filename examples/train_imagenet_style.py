"""ImageNet-style elastic training: a tiny ResNet on synthetic images, DDP, SGD + StepLR.

It follows the original TorchElastic ImageNet example (pytorch/elastic
``examples/imagenet/main.py``: DDP, SGD with momentum and weight decay, a step LR
schedule, top-1/top-5 accuracy, a checkpoint every epoch, resume) and fixes its flaws:

* **Checkpoints on the shared filesystem**, not node-local (the original wrote
  ``/tmp/checkpoint.pth.tar`` on each node and broadcast the newest one from whichever
  rank had it): ``CheckpointManager.from_env`` uses the run's directory the agent sets,
  commits by atomic rename with a CRC-checked manifest and resumes from the newest
  checkpoint that verifies.
* **Mid-epoch resume**: the original resumed at the start of the saved epoch, so a
  preemption lost up to a whole epoch and the samples of a partial epoch were seen twice.
  ``ElasticSampler`` resumes at the saved *global sample offset*, with any world size.
* **World-size-aware batch and LR**: the original kept the per-worker batch, so the global
  batch (and the effective LR) changed whenever the world did. Default here: a fixed
  global batch (``plan_batches`` + ``loss_scale``: the gradient is the mean over the same
  global batch at any world size). ``--local-batch N`` keeps the per-rank batch instead and
  scales the LR (``--lr-scaling linear|sqrt`` relative to ``--base-world-size``).
* **Membership changes in place** (``slurm_elastic.live.ElasticLoop``, as in
  ``examples/train_ddp.py``): a node that joins, leaves with notice or dies does not restart
  the others; they re-form the process group at a step boundary and newcomers receive the
  state from a survivor. The original restarted every worker and reloaded the checkpoint.
* **Progress reports** for the agent's hang watchdog (``notice.report_progress``).
* **Deterministic**: synthetic data from the seed (no download, no torchvision),
  GroupNorm instead of BatchNorm (batch statistics would depend on the per-rank share,
  so the math would change with the world size), deterministic kernels. An interrupted
  and resumed run ends bitwise equal to an uninterrupted one at the same world size.

CPU and gloo by default; CUDA and NCCL when a GPU is visible (``--cpu`` forces CPU). Run::

    slurm-elastic agent --nnodes 1:4 --nproc-per-node 2 --rdzv-id demo \\
        examples/train_imagenet_style.py --epochs 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from slurm_elastic import notice
from slurm_elastic.checkpoint import CheckpointManager, micro_batches, plan_batches
from slurm_elastic.live import ElasticLoop, Step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: no cap)")
    p.add_argument("--dataset-size", type=int, default=1024)
    p.add_argument("--val-size", type=int, default=256)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--width", type=int, default=16, help="channels of the first stage")
    p.add_argument("--global-batch", type=int, default=64, help="samples per step, all ranks")
    p.add_argument("--max-micro-batch", type=int, default=None, help="accumulate above this")
    p.add_argument(
        "--local-batch",
        type=int,
        default=None,
        help="keep the per-rank batch instead of the global one (LR scaled)",
    )
    p.add_argument("--lr-scaling", choices=("none", "linear", "sqrt"), default="linear")
    p.add_argument(
        "--base-world-size",
        type=int,
        default=None,
        help="world size the LR was tuned for (--local-batch only)",
    )
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--lr-step-epochs", type=int, default=2, help="StepLR period (epochs)")
    p.add_argument("--lr-gamma", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps")
    p.add_argument("--print-freq", type=int, default=10)
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="default: $SLURM_ELASTIC_CHECKPOINT_DIR (set by the agent)",
    )
    p.add_argument("--out", default=None, help="rank 0 writes the final parameters here")
    p.add_argument(
        "--leave-wait",
        type=float,
        default=60.0,
        help="after a peer's preemption save, wait this long for the new round",
    )
    p.add_argument("--cpu", action="store_true", help="ignore GPUs")
    return p.parse_args(argv)


class SyntheticImages:
    """ImageNet-shaped stand-in: image ``i`` = its class prototype + noise, all from the seed.

    Images are made on access (like decoding files), from a generator seeded with
    ``(seed, split, i)``: the same index gives the same image in every process and run.
    """

    def __init__(self, size: int, args: argparse.Namespace, split: int) -> None:
        shape = (args.num_classes, 3, args.image_size, args.image_size)
        self.prototypes = torch.randn(shape, generator=torch.Generator().manual_seed(args.seed))
        gen = torch.Generator().manual_seed(args.seed * 4 + split + 1)
        self.labels = torch.randint(args.num_classes, (size,), generator=gen)
        self.base = (args.seed * 4 + split) << 32

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, indices: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        shape = self.prototypes.shape[1:]
        images = [
            self.prototypes[self.labels[i]]
            + torch.randn(shape, generator=torch.Generator().manual_seed(self.base + i))
            for i in indices
        ]
        x = torch.stack(images) if images else torch.empty(0, *shape)
        return x.to(device), self.labels[indices].to(device)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(4, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(4, cout)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(4, cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(out)) + self.skip(x))


def tiny_resnet(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(args.seed)
    w = args.width
    return nn.Sequential(
        nn.Conv2d(3, w, 3, 1, 1, bias=False),
        nn.GroupNorm(4, w),
        nn.ReLU(),
        BasicBlock(w, w, 1),
        BasicBlock(w, 2 * w, 2),
        BasicBlock(2 * w, 4 * w, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * w, args.num_classes),
    )


def correct_topk(logits: torch.Tensor, target: torch.Tensor, ks: tuple[int, ...]) -> list[int]:
    """Number of samples whose target is among the top-k predictions, per k."""
    if len(target) == 0:
        return [0 for _ in ks]
    top = logits.topk(min(max(ks), logits.shape[1]), dim=1).indices
    hits = top.eq(target[:, None])
    return [int(hits[:, :k].any(dim=1).sum()) for k in ks]


def sum_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def validate(
    model: nn.Module, val: SyntheticImages, device: torch.device, batch: int
) -> tuple[float, float]:
    """Top-1/top-5 accuracy (%) on the validation split, shared out over the ranks."""
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = list(range(rank, len(val), world))
    hits = [0.0, 0.0]
    for i in range(0, len(mine), batch):
        x, y = val.batch(mine[i : i + batch], device)
        top = correct_topk(model(x), y, (1, 5))
        hits = [hits[0] + top[0], hits[1] + top[1]]
    model.train()
    top1, top5 = sum_over_ranks(hits, device)
    return 100 * top1 / len(val), 100 * top5 / len(val)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.use_deterministic_algorithms(True)
    notice.install_preemption_handler()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    world0 = int(os.environ.get("WORLD_SIZE", "1"))
    if args.local_batch:
        # The per-rank batch is kept, so the global batch and the LR follow the world
        # size: membership changes take the restart path (new plan, rescaled LR).
        os.environ["SLURM_ELASTIC_IN_PLACE"] = "0"
        plan = plan_batches(
            world0, local_batch_size=args.local_batch, mode="fixed_local",
            max_micro_batch=args.max_micro_batch, lr_scaling=args.lr_scaling,
            base_world_size=args.base_world_size,
        )  # fmt: skip
    else:  # default: the same global batch, so the same math, at any world size
        plan = plan_batches(
            world0, global_batch_size=args.global_batch, max_micro_batch=args.max_micro_batch
        )
    train = SyntheticImages(args.dataset_size, args, split=0)
    val = SyntheticImages(args.val_size, args, split=1)
    net = tiny_resnet(args).to(device)
    opt = torch.optim.SGD(
        net.parameters(), lr=args.lr * plan.lr_factor, momentum=args.momentum,
        weight_decay=args.weight_decay,
    )  # fmt: skip
    steps_per_epoch = -(-args.dataset_size // plan.global_batch_size)
    sched = torch.optim.lr_scheduler.StepLR(  # stepped every step: the period is in steps
        opt, step_size=max(1, args.lr_step_epochs * steps_per_epoch), gamma=args.lr_gamma
    )
    loop = ElasticLoop(
        net, opt, sched,
        dataset_size=args.dataset_size, global_batch_size=plan.global_batch_size,
        seed=args.seed, checkpoint=CheckpointManager.from_env(args.checkpoint_dir, keep_last=3),
        save_every=args.save_every, save_each_epoch=True, leave_wait_s=args.leave_wait,
        ddp_kwargs={"device_ids": [device.index]} if cuda else None,
        extra={"lr_factor": plan.lr_factor},
    )  # fmt: skip

    def train_step(s: Step) -> None:
        # the world may change between steps: plan the micro-batches for this one
        accumulation = plan_batches(
            s.world_size,
            global_batch_size=plan.global_batch_size,
            max_micro_batch=args.max_micro_batch,
        ).accumulation_steps
        opt.zero_grad(set_to_none=False)
        loss_sum, hits = 0.0, [0, 0]
        for chunk in micro_batches(s.indices, accumulation):
            x, y = train.batch(list(chunk), device)
            logits = s.model(x)
            loss = F.cross_entropy(logits, y, reduction="sum")
            (loss * s.loss_scale).backward()
            loss_sum += loss.item()
            top = correct_topk(logits.detach(), y, (1, 5))
            hits = [hits[0] + top[0], hits[1] + top[1]]
        opt.step()
        sched.step()
        if (s.step + 1) % args.print_freq == 0:
            total, top1, top5 = sum_over_ranks([loss_sum, *hits], device)
            if s.rank == 0:
                n = s.global_size
                print(
                    f"epoch {s.epoch} step {s.step + 1} loss {total / n:.4f} top1 "
                    f"{100 * top1 / n:.1f} top5 {100 * top5 / n:.1f} world {s.world_size}",
                    flush=True,
                )
        if args.step_time:
            time.sleep(args.step_time)

    def end_of_epoch(epoch: int) -> None:  # validate, as the original did
        top1, top5 = validate(loop.model, val, device, plan.max_micro_batch)
        if loop.rank == 0:
            print(f"epoch {epoch} done: val top1 {top1:.1f} top5 {top5:.1f}", flush=True)

    loop.start()
    if loop.resume_extra:
        # StepLR is chainable (it multiplies the current LR), so rescaling the LR for a
        # new world size keeps the schedule position.
        for group in opt.param_groups:
            group["lr"] *= plan.lr_factor / float(loop.resume_extra.get("lr_factor", 1.0))
    if loop.rank == 0 and loop.resume_world_size is not None:
        print(
            f"resumed at step {loop.step} (epoch {loop.epoch}, offset {loop.sample_offset}); "
            f"world {loop.resume_world_size} -> {loop.world_size}",
            flush=True,
        )
    outcome = loop.run(
        train_step,
        epochs=args.epochs,
        steps=args.steps or None,
        on_epoch_end=end_of_epoch,
    )
    if outcome == "done" and loop.rank == 0 and args.out:
        params = {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}
        torch.save(params, f"{args.out}.tmp")
        os.replace(f"{args.out}.tmp", args.out)
    loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
