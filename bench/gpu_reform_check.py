"""One-shot GPU check of in-place re-formation (NCCL/CUDA): run once on a GPU machine.

    python bench/gpu_reform_check.py            # < 2 minutes, prints PASS/FAIL/SKIP lines

What ``slurm_elastic.live`` does on gloo, checked here on CUDA, with 2 processes:

1. ``nccl_reinit``: init a NCCL group on a fresh store prefix, wrap a CUDA model in DDP,
   train 3 steps, tear down in the safe order (keep the group, drop DDP, destroy, drop
   the group), repeat 5 times; parameters must agree across ranks every cycle and CUDA
   memory must not grow. NCCL refuses two ranks on one GPU ("Duplicate GPU detected"),
   so with one GPU each process forms its own 1-rank world (the re-init and the CUDA
   state are still exercised, the cross-rank traffic is not).
2. ``gloo_cuda_peer_loss``: 2 ranks on the same GPU, gloo on CUDA tensors, DDP: rank 1
   dies (``os._exit``) mid-training; rank 0 must get an exception (not hang, not die),
   tear down, re-form a world of 1 on a new prefix and train on.
3. ``nccl_abort``: with >= 2 GPUs, rank 1 dies mid-collective; rank 0 runs with
   ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (abort the communicator, keep the process) and a
   10 s timeout: the collective must raise within the timeout, the group must be
   aborted/destroyed, and a new 1-rank NCCL group must work. With one GPU: the abort API
   on a 1-rank group is checked (abort, then re-init) and the peer-loss part is SKIP.

Each case prints ``PASS``/``FAIL``/``SKIP`` with timings; the exit status is 1 if any
case failed. CPU-only machines: every case is SKIP.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

TIMEOUT = timedelta(seconds=10)
#: ``--cpu-dry-run``: the same harness on CPU with gloo (checks the script, not CUDA)
DRY = os.environ.get("GPU_REFORM_DRY_RUN") == "1"
NCCL = "gloo" if DRY else "nccl"


def _device(index: int) -> torch.device:
    return torch.device("cpu") if DRY else torch.device("cuda", index)


def _use(device: torch.device) -> None:
    if not DRY:
        torch.cuda.set_device(device)


def _sync(device: torch.device) -> None:
    if not DRY:
        torch.cuda.synchronize(device)


def _mem(device: torch.device) -> int:
    return 0 if DRY else torch.cuda.memory_allocated(device)


def _ddp(model: nn.Module, device: torch.device) -> DistributedDataParallel:
    return DistributedDataParallel(model, device_ids=None if DRY else [device.index])


def _init(backend: str, store: Any, rank: int, world: int, device: torch.device) -> None:
    extra = {} if DRY or backend == "gloo" else {"device_id": device}
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=TIMEOUT, **extra
    )


def _store(port: int) -> dist.Store:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).to(device)


def _train(ddp: nn.Module, opt: torch.optim.Optimizer, device: torch.device, n: int) -> None:
    for i in range(n):
        x = torch.randn(32, 64, device=device, generator=None) * (i + 1)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    _sync(device)


def _digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _teardown(holder: dict[str, Any]) -> None:
    group = dist.group.WORLD if dist.is_initialized() else None  # hold it
    holder.pop("ddp", None)  # drop the DDP wrapper first
    if group is not None:
        dist.destroy_process_group()
    del group


def _nccl_reinit(rank: int, port: int, gpus: int) -> dict[str, Any]:
    device = _device(rank % gpus)
    _use(device)
    world = 2 if gpus >= 2 else 1
    my_rank = rank if world == 2 else 0
    store = _store(port)
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    holder: dict[str, Any] = {}
    mem, times, digests = [], [], []
    for cycle in range(5):
        started = time.monotonic()
        prefix = f"nccl_reinit.{cycle}" if world == 2 else f"nccl_reinit.{rank}.{cycle}"
        _init(NCCL, dist.PrefixStore(prefix, store), my_rank, world, device)
        holder["ddp"] = _ddp(model, device)
        _train(holder["ddp"], opt, device, 3)
        digests.append(_digest(model))
        _teardown(holder)
        times.append(time.monotonic() - started)
        mem.append(_mem(device))
    return {"world": world, "digests": digests, "mem": mem, "cycle_s": times}


def _gloo_cuda_peer_loss(rank: int, port: int, gpus: int) -> dict[str, Any]:
    device = _device(0)
    _use(device)
    store = _store(port)
    _init("gloo", dist.PrefixStore("gloo.0", store), rank, 2, device)
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    holder: dict[str, Any] = {"ddp": DistributedDataParallel(model)}
    _train(holder["ddp"], opt, device, 3)
    store.set(f"trained/{rank}", "1")
    store.wait(["trained/0", "trained/1"])
    if rank == 1:
        os._exit(0)  # the peer dies without a goodbye
    error, started = None, time.monotonic()
    try:
        _train(holder["ddp"], opt, device, 50)
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc)[:200]}"
    noticed = time.monotonic() - started
    _teardown(holder)
    _init("gloo", dist.PrefixStore("gloo.1", store), 0, 1, device)
    holder["ddp"] = DistributedDataParallel(model)
    _train(holder["ddp"], opt, device, 3)
    _teardown(holder)
    return {"error": error, "noticed_s": noticed}


def _nccl_abort(rank: int, port: int, gpus: int) -> dict[str, Any]:
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"  # abort comms, keep the process
    os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"  # a timed-out collective raises here
    device = _device(rank % gpus)
    _use(device)
    store = _store(port)
    world = 2 if gpus >= 2 else 1
    if rank >= world:
        return {"skipped": True}
    _init(NCCL, dist.PrefixStore("abort.0", store), rank, world, device)
    t = torch.ones(1 << 20, device=device)
    dist.all_reduce(t)
    _sync(device)
    error, noticed = None, 0.0
    if world == 2:
        store.set(f"ready/{rank}", "1")
        store.wait(["ready/0", "ready/1"])
        if rank == 1:
            os._exit(0)
        started = time.monotonic()
        try:
            for _ in range(1000):
                dist.all_reduce(t)
                _sync(device)
        except Exception as exc:
            error = f"{type(exc).__name__}: {str(exc)[:200]}"
        noticed = time.monotonic() - started
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        abort()
    else:
        dist.destroy_process_group()
    _init(NCCL, dist.PrefixStore("abort.1", store), 0, 1, device)
    t2 = torch.ones(4, device=device)
    dist.all_reduce(t2)
    _sync(device)
    ok = bool(t2.sum().item() == 4)
    dist.destroy_process_group()
    return {"world": world, "error": error, "noticed_s": noticed, "reinit_ok": ok}


CASES = {"nccl_reinit": _nccl_reinit, "gloo_cuda_peer_loss": _gloo_cuda_peer_loss,
         "nccl_abort": _nccl_abort}  # fmt: skip


def _child(case: str, rank: int, port: int, gpus: int, conn: Any) -> None:
    try:
        conn.send(("ok", CASES[case](rank, port, gpus)))
    except BaseException:
        conn.send(("error", traceback.format_exc()[-1500:]))
    conn.close()


def run_case(case: str, gpus: int, limit_s: float = 35.0) -> tuple[str, str]:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(2):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(case, rank, master.port, gpus, child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        for rank, pipe in enumerate(pipes):
            if rank not in results and pipe.poll(0):
                try:
                    results[rank] = pipe.recv()
                except EOFError:  # a rank that exits on purpose sends nothing
                    results[rank] = ("exited", None)
        if len(results) == len(pipes) or not any(p.is_alive() for p in procs):
            break
        time.sleep(0.05)
    for proc in procs:
        proc.join(max(0.1, min(5.0, deadline - time.monotonic())))
        if proc.is_alive():
            proc.kill()
    return _judge(case, gpus, results)


def _judge(case: str, gpus: int, results: dict[int, Any]) -> tuple[str, str]:
    r0 = results.get(0)
    if r0 is None:
        return "FAIL", "rank 0 reported nothing (hung or died)"
    if r0[0] != "ok":
        return "FAIL", str(r0[1])
    value = r0[1]
    if case == "nccl_reinit":
        r1 = results.get(1)
        if r1 is None or r1[0] != "ok":  # rank 1 must finish too
            return "FAIL", f"rank 1: {r1}"
        same = value["world"] == 1 or value["digests"] == r1[1]["digests"]
        grew = value["mem"][-1] > value["mem"][1] + (1 << 20)
        detail = (
            f"world={value['world']} cycles={len(value['cycle_s'])} "
            f"cycle_s={[round(t, 3) for t in value['cycle_s']]} mem={value['mem']}"
        )
        return ("PASS" if same and not grew else "FAIL"), detail
    if case == "gloo_cuda_peer_loss":
        ok = value["error"] is not None and value["noticed_s"] < TIMEOUT.total_seconds() + 2
        return (
            "PASS" if ok else "FAIL"
        ), f"noticed in {value['noticed_s']:.2f} s: {value['error']}"
    if value["world"] < 2:
        status = "PASS" if value["reinit_ok"] else "FAIL"
        return status, "1 GPU: abort + re-init of a 1-rank group only; peer loss SKIPPED"
    ok = value["error"] is not None and value["reinit_ok"]
    ok = ok and value["noticed_s"] < TIMEOUT.total_seconds() + 5
    return ("PASS" if ok else "FAIL"), f"noticed in {value['noticed_s']:.2f} s: {value['error']}"


def main() -> int:
    if "--cpu-dry-run" in sys.argv[1:]:
        os.environ["GPU_REFORM_DRY_RUN"] = "1"  # inherited by the spawned ranks
        global DRY, NCCL
        DRY, NCCL = True, "gloo"
        gpus = int(os.environ.get("GPU_REFORM_DRY_GPUS", "1"))
        print(f"CPU dry run (gloo) as if {gpus} GPU(s): checks the harness, not CUDA")
    elif not torch.cuda.is_available():
        for case in CASES:
            print(f"SKIP {case}: no CUDA device (--cpu-dry-run checks the harness)")
        return 0
    else:
        gpus = torch.cuda.device_count()
        print(f"torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, {gpus} GPU(s)")
    failed = False
    for case in CASES:
        started = time.monotonic()
        status, detail = run_case(case, gpus, 120.0 if DRY else 35.0)
        failed |= status == "FAIL"
        print(f"{status} {case} ({time.monotonic() - started:.1f} s): {detail}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
