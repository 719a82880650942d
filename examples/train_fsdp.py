"""A small transformer sharded with FSDP2 (``fully_shard``), or HSDP with ``--hsdp R``.

What it shows: ``slurm_elastic.live.ElasticSession(..., fsdp=FSDPConfig(...))`` around a
plain loop: the model is sharded on a device mesh over the current world (``--hsdp R``: a
``(replicate, shard)`` mesh with R replicas) and re-sharded in place when a node joins or
leaves with notice: survivors keep their processes, a newcomer gets its shards from the
survivors over the network (tensors plus a JSON description, no pickle), no step is lost
and every sample is used once per epoch. A node lost without notice is rebuilt in place
from the survivors' shards: a surviving replica with ``--hsdp R``, else the copies each
rank keeps of its neighbour node's shards every ``--copy-every`` steps (default 50). The same flags and ledger rows as
``examples/train_ddp.py``, so the same tests and benches run it::

    slurm-elastic agent --nnodes 1:4 --nproc-per-node 2 examples/train_fsdp.py --steps 200
    slurm-elastic agent --nnodes 2:4 --nproc-per-node 2 examples/train_fsdp.py --hsdp 2

CPU and gloo work (``init_device_mesh("cpu", ...)``); with CUDA the mesh is on the GPUs.
:func:`reference` is the uninterrupted math in one process (the tests compare with it).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from slurm_elastic import ledger, notice
from slurm_elastic.checkpoint import CheckpointManager, ElasticSampler, loss_scale
from slurm_elastic.live import ElasticSession, FSDPConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in total")
    p.add_argument("--dataset-size", type=int, default=1000)
    p.add_argument("--global-batch", type=int, default=32, help="samples per step, all ranks")
    p.add_argument("--hsdp", type=int, default=1, help="replicas (1: FSDP2 over all ranks)")
    p.add_argument(
        "--copy-every", type=int, default=None,
        help="plain FSDP2: steps between neighbour copies of the shards (0: none; default 50)",
    )  # fmt: skip
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--seq", type=int, default=8, help="tokens per sample")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    p.add_argument(
        "--pace-until-file",
        default=None,
        help="with --step-time: pause only until this file exists (a test creates it once "
        "what it waits for has happened: then the training runs at full speed)",
    )
    p.add_argument("--checkpoint-dir", default=None, help="default: $SLURM_ELASTIC_CHECKPOINT_DIR")
    p.add_argument("--out", default=None, help="rank 0 writes the final parameters here")
    p.add_argument("--ledger", default=None, help="append consumed sample indices (JSONL)")
    p.add_argument("--leave-wait", type=float, default=60.0)
    p.add_argument("--reform-timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    if args.hsdp < 1:
        p.error(f"--hsdp {args.hsdp}: must be >= 1 (1: plain FSDP2)")
    if args.copy_every is not None and args.copy_every < 0:
        p.error(f"--copy-every {args.copy_every}: must be >= 0 (0: no neighbour copies)")
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    return args


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP (explicit math: empty batches work)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # no q/k/v bias: a key bias gets a zero gradient (softmax is shift-invariant),
        # and Adam would turn rounding noise on it into steps
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.dim)
        self.pos = nn.Parameter(0.02 * torch.randn(args.seq, args.dim))
        self.blocks = nn.ModuleList(Block(args.dim, args.heads) for _ in range(args.layers))
        self.norm = nn.LayerNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(args: argparse.Namespace) -> TinyTransformer:
    torch.manual_seed(args.seed)
    return TinyTransformer(args)


def synthetic_data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic progressions mod ``vocab``: predict each next token."""
    gen = torch.Generator().manual_seed(args.seed)
    start = torch.randint(args.vocab, (args.dataset_size, 1), generator=gen)
    stride = torch.randint(1, args.vocab, (args.dataset_size, 1), generator=gen)
    seq = (start + stride * torch.arange(args.seq + 1)) % args.vocab
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def loss_of(model: nn.Module, args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor,
            scale: float) -> torch.Tensor:  # fmt: skip
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1), reduction="sum")
    return loss / args.seq * scale


def make_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    notice.install_preemption_handler()
    x, y = synthetic_data(args)
    net = build_model(args)
    opt = make_optimizer(net, args)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
    session = ElasticSession(
        net, opt, sched,
        fsdp=FSDPConfig(build=lambda: build_model(args), shard_modules=lambda m: m.blocks,
                        replicate=args.hsdp, copy_every=args.copy_every),
        dataset_size=args.dataset_size, global_batch_size=args.global_batch, seed=args.seed,
        checkpoint=CheckpointManager.from_env(args.checkpoint_dir, keep_last=3),
        save_every=args.save_every, leave_wait_s=args.leave_wait,
        reform_timeout_s=args.reform_timeout,
    )  # fmt: skip
    while not session.finished(steps=args.steps):
        for _ in session.batches():
            with session.step() as s:
                if args.ledger:  # at the start: a failed attempt is superseded by its redo
                    ledger.append(args.ledger, epoch=s.epoch, step=s.step + 1, rank=s.rank,
                                  world=s.world_size, indices=s.indices,
                                  attempt=f"round{s.round}", round=s.round,
                                  pid=os.getpid())  # fmt: skip
                loss = loss_of(session.model, args, x[s.indices], y[s.indices], s.loss_scale)
                opt.zero_grad(set_to_none=False)
                loss.backward()
                opt.step()
                sched.step()
                if s.rank == 0 and (s.step + 1) % 10 == 0:
                    print(f"step {s.step + 1} loss {loss.item():.5f} world {s.world_size}",
                          flush=True)  # fmt: skip
                released = args.pace_until_file and os.path.exists(args.pace_until_file)
                if args.step_time and not released:
                    time.sleep(args.step_time)
            if session.interrupted or session.reached(steps=args.steps):
                break
    outcome = session.finish()
    if outcome == "done" and args.out and session.sharded is not None:
        session.sharded.gather()  # collective: the full parameters on every rank
        if session.rank == 0:
            params = dict(session.sharded.state_dict()["model"])
            torch.save(params, f"{args.out}.tmp")
            os.replace(f"{args.out}.tmp", args.out)
    session.close()
    return 0


def reference(argv: list[str]) -> dict[str, torch.Tensor]:
    """The uninterrupted run's math in this process (one rank, the same global batches)."""
    args = parse_args(argv)
    torch.use_deterministic_algorithms(True)
    x, y = synthetic_data(args)
    net = build_model(args)
    opt = make_optimizer(net, args)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
    sampler = ElasticSampler(args.dataset_size, args.global_batch, rank=0, world_size=1,
                             seed=args.seed)  # fmt: skip
    done, epoch = 0, 0
    while done < args.steps:
        sampler.set_epoch(epoch, 0)
        for piece in sampler.slices():
            idx = piece.indices
            loss = loss_of(net, args, x[idx], y[idx], loss_scale(piece.global_size, 1))
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            sched.step()
            done += 1
            if done >= args.steps:
                break
        epoch += 1
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


if __name__ == "__main__":
    sys.exit(main())
