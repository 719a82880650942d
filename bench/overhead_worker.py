"""Worker of bench/overhead.py: the same MLP, data and steps in one of three loops.

Usage (under ``slurm-elastic agent``): ``overhead_worker.py MODE OUT_DIR [options]``
with MODE one of

* ``plain``: a hand-written DDP loop (``init_process_group``, ``DistributedDataParallel``,
  each rank's share of a seeded permutation, forward, backward, ``optimizer.step()``);
* ``session``: the own-loop API at its defaults (``ElasticSession``,
  ``with session.step() as s:``; no checkpoint, ``commit_every=0``);
* ``loop``: ``ElasticLoop.run(train_step)`` at its defaults.

Each rank writes ``OUT_DIR/<mode>.<rank>.json``: the ``time.perf_counter()`` at the start
of each step (session: before ``with session.step()``; loop: at the start of the step
function), at the start and the end of its body (the user's code: batch, forward,
backward, optimizer), and the process's peak resident memory (``ru_maxrss``) at the end.
The time per step is the time between the starts of consecutive steps, so whatever a
loop adds between two bodies (our step boundary) is in it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["plain", "session", "loop", "ab", "null"])
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--width", type=int, default=2048, help="hidden width of the MLP")
    p.add_argument("--features", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block", type=int, default=5, help="ab: steps per block")
    p.add_argument(
        "--fsdp", action="store_true", help="FSDP2: each Linear, then the root, fully_shard-ed"
    )
    p.add_argument(
        "--copy-every", type=int, default=None,
        help="FSDP2: neighbour copies every K steps, each rank standing in for one node "
        "(LOCAL_WORLD_SIZE=1 in the worker: its neighbour is the other rank)",
    )  # fmt: skip
    p.add_argument(
        "--copy-wait", action="store_true",
        help="with --copy-every: wait for each copy at its boundary (as a synchronous copy)",
    )  # fmt: skip
    p.add_argument(
        "--vote-interval", type=float, default=None,
        help="the session's vote_interval_s (default: the session's default)",
    )  # fmt: skip
    p.add_argument(
        "--model", choices=["mlp", "transformer"], default="mlp",
        help="transformer: the TinyTransformer of examples/train_fsdp.py (TRANSFORMER)",
    )  # fmt: skip
    p.add_argument(
        "--ab-cadence", choices=["session", "wall"], default="session",
        help="ab: the clock of the session's vote cadence: 'session' leaves the plain "
        "blocks out (a real run has nothing between its steps), 'wall' counts them",
    )  # fmt: skip
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu",
        help="cuda: the model and data on cuda:LOCAL_RANK, NCCL (one rank per GPU)",
    )  # fmt: skip
    return p.parse_args(argv)


def device_of(args: argparse.Namespace) -> torch.device:
    if args.device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def backend_of(args: argparse.Namespace) -> str:
    return "nccl" if args.device == "cuda" else "gloo"


def sync(args: argparse.Namespace) -> None:
    """Wait for the device's queued work (CUDA: the host runs ahead of the kernels)."""
    if args.device == "cuda":
        torch.cuda.synchronize()


def init_plain(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        dist.init_process_group("nccl", device_id=device_of(args))
    else:
        dist.init_process_group("gloo")


def vote_options(args: argparse.Namespace) -> dict[str, Any]:
    return {} if args.vote_interval is None else {"vote_interval_s": args.vote_interval}


def ddp_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"device_ids": [device_of(args).index]} if args.device == "cuda" else {}


LINEARS = (0, 2, 4)  # the Linear layers of the Sequential: FSDP2's units
# --model transformer: examples/train_fsdp.py's model at this size (its defaults are a
# 2-layer, 16-wide toy whose step is a few ms: a host-bound case, not a training step)
TRANSFORMER = {"vocab": 256, "seq": 32, "dim": 128, "heads": 4, "layers": 4}
#: the model's parameter count (set by build)
PARAMS = [0]


def example(args: argparse.Namespace) -> tuple[Any, argparse.Namespace]:
    """examples/train_fsdp.py and its arguments at the TRANSFORMER size."""
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    if examples not in sys.path:  # build() runs once per model
        sys.path.insert(0, examples)
    import train_fsdp

    ex = train_fsdp.parse_args([])
    for key, value in TRANSFORMER.items():
        setattr(ex, key, value)
    ex.seed, ex.dataset_size = args.seed, args.global_batch * args.steps
    return train_fsdp, ex


def units(model: nn.Module) -> list[nn.Module]:
    """FSDP2's units: the MLP's Linear layers, or the transformer's blocks."""
    blocks = getattr(model, "blocks", None)
    return list(blocks) if blocks is not None else [model[i] for i in LINEARS]


def fsdp_config(args: argparse.Namespace) -> Any:
    """The session's sharding (``None`` for DDP): the same units as :func:`shard_plain`."""
    if not args.fsdp:
        return None
    from slurm_elastic.live import FSDPConfig

    if args.copy_every is not None:
        os.environ["LOCAL_WORLD_SIZE"] = "1"  # read when the session shards the model
    return FSDPConfig(
        build=lambda: build(args)[0],
        shard_modules=units,
        copy_every=args.copy_every,
    )


def shard_plain(model: nn.Module, args: argparse.Namespace) -> tuple[nn.Module, Any]:
    """A hand-written FSDP2 wrap (each Linear, then the root, on a 1-D mesh over the
    world) and the Adam built on its sharded parameters, as FSDP2's docs do it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(args.device, (dist.get_world_size(),))
    for unit in units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def build(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    """The model (3 Linear layers), its Adam, and a dataset of one sample per step slot
    (on the device: a batch is indexed there, no host-to-device copy per step)."""
    torch.manual_seed(args.seed)
    f, w = args.features, args.width
    device = device_of(args)
    size = args.global_batch * args.steps  # one epoch: no epoch boundary inside the run
    if args.model == "transformer":
        mod, ex = example(args)
        model = mod.build_model(ex).to(device)
        x, y = (t.to(device) for t in mod.synthetic_data(ex))
        LOSS[0] = lambda m, xb, yb, scale: mod.loss_of(m, ex, xb, yb, scale)
    else:
        model = nn.Sequential(
            nn.Linear(f, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, f)
        ).to(device)
        gen = torch.Generator(device).manual_seed(args.seed + 1)
        x = torch.randn(size, f, generator=gen, device=device)
        y = torch.randn(size, f, generator=gen, device=device)
    PARAMS[0] = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt, x, y


#: the loss (set by build for the transformer: the example's cross-entropy)
LOSS: list[Any] = [lambda model, x, y, scale: ((model(x) - y) ** 2).sum() * scale]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: Any, y: Any, scale: float) -> None:
    loss = LOSS[0](model, x, y, scale)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


Marks = list[tuple[float, float, float]]  # (step starts, body starts, body ends)


def run_plain(args: argparse.Namespace, marks: Marks) -> int:
    from torch.nn.parallel import DistributedDataParallel

    init_plain(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, x, y = build(args)
    if args.fsdp:
        ddp, opt = shard_plain(model, args)
    else:
        ddp = DistributedDataParallel(model, **ddp_kwargs(args))
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(args.seed)).tolist()
    b = args.global_batch
    per = b // world
    for step in range(args.steps):
        t0 = time.perf_counter()
        idx = order[step * b + rank * per : step * b + (rank + 1) * per]
        train_step(ddp, opt, x[idx], y[idx], 1.0 / b * world)
        marks.append((t0, t0, time.perf_counter()))
    sync(args)
    dist.barrier()
    dist.destroy_process_group()
    return rank


def run_session(args: argparse.Namespace, marks: Marks) -> int:
    from slurm_elastic.live import ElasticSession

    model, opt, x, y = build(args)
    session = ElasticSession(
        model, opt, dataset_size=len(x), global_batch_size=args.global_batch, seed=args.seed,
        fsdp=fsdp_config(args), backend=backend_of(args), ddp_kwargs=ddp_kwargs(args),
        **vote_options(args),
    )  # fmt: skip
    while not session.finished(steps=args.steps):
        for _ in session.batches():
            t0 = time.perf_counter()
            with session.step() as s:
                tb = time.perf_counter()
                train_step(session.model, opt, x[s.indices], y[s.indices], s.loss_scale)
                marks.append((t0, tb, time.perf_counter()))
            if session.interrupted or session.reached(steps=args.steps):
                break
    session.finish()
    rank = session.rank
    session.close()
    return rank


def run_loop(args: argparse.Namespace, marks: Marks) -> int:
    from slurm_elastic.live import ElasticLoop

    model, opt, x, y = build(args)
    loop = ElasticLoop(
        model, opt, dataset_size=len(x), global_batch_size=args.global_batch,
        fsdp=fsdp_config(args), backend=backend_of(args), ddp_kwargs=ddp_kwargs(args),
        **vote_options(args),
    )  # fmt: skip

    def one(step: Any) -> None:
        t0 = time.perf_counter()
        train_step(step.model, opt, x[step.indices], y[step.indices], step.loss_scale)
        marks.append((t0, t0, time.perf_counter()))

    loop.run(one, steps=args.steps)
    rank = loop.rank
    loop.close()
    return rank


def threads_cpu_s() -> dict[str, float]:
    """CPU seconds used so far by every Python thread of this process but the main one
    (in the ab run: the threads the session started, e.g. its stall guard; the plain loop
    starts none), by thread name."""
    used: dict[str, float] = {}
    for t in threading.enumerate():
        if t is threading.main_thread() or t.ident is None:
            continue
        try:
            clock = time.pthread_getcpuclockid(t.ident)
            used[t.name] = used.get(t.name, 0.0) + time.clock_gettime(clock)
        except (OSError, ProcessLookupError):  # it ended meanwhile
            continue
    return used


def counting_cadence(interval_s: float, clock: Any = None) -> Any:
    """The session's vote cadence (``Cadence``, on ``clock`` if given), counting the
    votes held (``.votes``)."""
    from slurm_elastic.live.boundary import Cadence

    class Counting(Cadence):
        votes = 0

        def agreed(self, step: int, round_: int, steps: int) -> None:
            self.votes += 1
            super().agreed(step, round_, steps)

    return Counting(interval_s) if clock is None else Counting(interval_s, clock=clock)


def run_ab(args: argparse.Namespace, out: dict[str, Any]) -> int:
    """Both loops in the same processes, alternating blocks of ``--block`` steps.

    A plain DDP wrapper of a second, identical model shares the session's process group;
    each block runs ``--block`` steps of one loop, then the other's. Per step the time
    from its start to the end of its loop's bookkeeping (the session: after the ``with``
    block, its step boundary included; plain: after the optimizer step).
    """
    from torch.nn.parallel import DistributedDataParallel

    from slurm_elastic.live import ElasticSession

    model, opt, x, y = build(args)
    plain_model, plain_opt, _, _ = build(args)
    session = ElasticSession(
        model, opt, dataset_size=len(x), global_batch_size=args.global_batch, seed=args.seed,
        fsdp=fsdp_config(args), backend=backend_of(args), ddp_kwargs=ddp_kwargs(args),
        **vote_options(args),
    )  # fmt: skip
    # The cadence fixes the steps between votes from the time between boundaries; here
    # that time would include the plain blocks between the session's (about twice a
    # real run's step, so twice as many votes per step): its clock leaves them out.
    paused = [0.0]
    clock = (lambda: time.perf_counter() - paused[0]) if args.ab_cadence == "session" else None
    session.cadence = cadence = counting_cadence(session.cadence.interval_s, clock=clock)
    session.start()
    if args.fsdp:
        ddp, plain_opt = shard_plain(plain_model, args)
    else:
        ddp = DistributedDataParallel(plain_model, **ddp_kwargs(args))
    rank, world = session.rank, session.world_size
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(args.seed)).tolist()
    b, per = args.global_batch, args.global_batch // world
    plain_marks: list[tuple[int, float, float]] = []
    session_marks: list[tuple[int, float, float]] = []
    # per block (block, start, end), each block between two barriers: both loops' blocks
    # start with the ranks aligned and include every wait for the other rank (a loop
    # that synchronises at its end, as the session's vote does, is not favoured)
    blocks: dict[str, list[tuple[int, float, float]]] = {"plain": [], "session": []}
    plain_step = 0
    session_start = 0.0
    threads_before = threads_cpu_s()  # the session's start (its first commit) not counted
    while not session.finished(steps=args.steps):
        for _ in session.batches():
            if session.step_count % args.block == 0:  # a plain block first
                block = session.step_count // args.block
                pause = time.perf_counter()
                sync(args)
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.block):
                    t0 = time.perf_counter()
                    i = plain_step % args.steps
                    idx = order[i * b + rank * per : i * b + (rank + 1) * per]
                    train_step(ddp, plain_opt, x[idx], y[idx], 1.0 / b * world)
                    plain_marks.append((block, t0, time.perf_counter()))
                    plain_step += 1
                sync(args)
                dist.barrier()
                blocks["plain"].append((block, start, time.perf_counter()))
                dist.barrier()
                session_start = time.perf_counter()
                paused[0] += session_start - pause
            block = session.step_count // args.block
            t0 = time.perf_counter()
            with session.step() as s:
                train_step(session.model, opt, x[s.indices], y[s.indices], s.loss_scale)
            if args.copy_wait and session.sharded is not None:
                session.sharded.wait_copy()
            session_marks.append((block, t0, time.perf_counter()))
            if session.step_count % args.block == 0:
                sync(args)
                dist.barrier()
                blocks["session"].append((block, session_start, time.perf_counter()))
            if session.interrupted or session.reached(steps=args.steps):
                break
    if session.sharded is not None:
        session.sharded.wait_copy()
        out["copy_step"] = session.sharded.copy_step
    # what the ab ratio does not see: a thread runs through both loops' blocks alike
    out["threads_cpu_s"] = {
        name: cpu - threads_before.get(name, 0.0) for name, cpu in threads_cpu_s().items()
    }
    out["session_steps"] = len(session_marks)
    out["votes"] = cadence.votes
    session.finish()
    del ddp
    session.close()
    out["plain"], out["session"] = plain_marks, session_marks
    out["blocks"] = blocks
    return rank


def run_null(args: argparse.Namespace, out: dict[str, Any]) -> int:
    """The null control of :func:`run_ab`: the same alternating blocks, each timed between
    two barriers, but both loops plain DDP (or plain FSDP2 with ``--fsdp``) on two
    identical models (the first built takes
    the plain loop's place, the second the session's). Its ratio would be 1 with no noise
    and no bias: its spread is what one same-processes run can resolve."""
    from torch.nn.parallel import DistributedDataParallel

    init_plain(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    loops = []
    for _ in range(2):
        model, opt, x, y = build(args)
        if args.fsdp:
            loops.append(shard_plain(model, args))
        else:
            loops.append((DistributedDataParallel(model, **ddp_kwargs(args)), opt))
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(args.seed)).tolist()
    b, per = args.global_batch, args.global_batch // world
    blocks: dict[str, list[tuple[int, float, float]]] = {"plain": [], "session": []}
    step = 0
    for block in range(args.steps // args.block):
        for (model, opt), name in zip(loops, ("plain", "session"), strict=True):
            sync(args)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.block):
                i = step % args.steps
                idx = order[i * b + rank * per : i * b + (rank + 1) * per]
                train_step(model, opt, x[idx], y[idx], 1.0 / b * world)
                step += 1
            sync(args)
            dist.barrier()
            blocks[name].append((block, start, time.perf_counter()))
    out["blocks"] = blocks
    dist.destroy_process_group()
    return rank


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(device_of(args))  # as a user's script does, before the session
    marks: Marks = []
    record: dict[str, Any] = {}
    if args.mode == "ab":
        rank = run_ab(args, record)
    elif args.mode == "null":
        rank = run_null(args, record)
    else:
        run = {"plain": run_plain, "session": run_session, "loop": run_loop}[args.mode]
        rank = run(args, marks)
    record |= {
        "mode": args.mode,
        "rank": rank,
        "starts": [m[0] for m in marks],
        "bodies": [m[1] for m in marks],
        "ends": [m[2] for m in marks],
        "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "params": PARAMS[0],
    }
    path = os.path.join(args.out, f"{args.mode}.{rank}.json")
    with open(f"{path}.tmp", "w") as fh:
        json.dump(record, fh)
    os.replace(f"{path}.tmp", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
