"""One rank of tests/live/test_fsdp_shards.py: a real gloo group of 4 trains a small model
under FSDP2/HSDP, some ranks die (``os._exit``: their sockets close, nothing is
gathered), and the survivors rebuild the full state from their shards in a new group.

Usage: shards_worker.py CASE RANK PORT NEW_PORT OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from slurm_elastic.errors import ShardsLostError
from slurm_elastic.live.fsdp import FSDPConfig, ShardedModel

WORLD = 4
STEPS = 3
# case: (replicate, the old ranks that die, the old rank that forgets what it kept and
# joins the new world as a newcomer would (or None), the steps of neighbour copies)
CASES: dict[str, tuple[int, tuple[int, ...], int | None, tuple[int, ...]]] = {
    "hsdp_replica_lost": (2, (2, 3), None, ()),
    "hsdp_one_rank_lost_and_a_newcomer": (2, (3,), 2, ()),
    "fsdp_shards_lost": (1, (2, 3), None, ()),
    "fsdp_neighbour_copy": (1, (2, 3), None, (2,)),
    # the lost ranks freeze before the copy of step 3: it stays in flight on 0 and 1
    "fsdp_copy_in_flight": (1, (2, 3), None, (1, 3)),
}
LOCAL_WORLD = 2  # two "nodes" of 2 ranks: a rank's neighbour is rank + 2


def build() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3))  # 7, 3: uneven
    net.register_buffer("seen", torch.arange(4.0))
    return net


def full_state(module: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Collective: the full state by name, straight from the DTensors (the reference)."""
    out = {}
    for key, value in module.state_dict().items():
        out[f"model.{key}"] = value.full_tensor() if isinstance(value, DTensor) else value
    for name, param in module.named_parameters():
        for key, value in opt.state[param].items():
            out[f"opt.{name}.{key}"] = value.full_tensor() if isinstance(value, DTensor) else value
    return {k: v.detach().clone() for k, v in out.items()}


def rebuilt_state(sharded: ShardedModel) -> dict[str, torch.Tensor]:
    full = sharded.state_dict()
    out = {f"model.{k}": v for k, v in full["model"].items()}
    for name, entry in full["optimizer"]["state"].items():
        out.update({f"opt.{name}.{k}": v for k, v in entry.items()})
    return out


def wait_for(paths: list[Path], deadline_s: float = 120.0) -> None:
    end = time.monotonic() + deadline_s
    while not all(p.exists() for p in paths):
        if time.monotonic() > end:
            raise TimeoutError(f"waited {deadline_s} s for {paths}")
        time.sleep(0.02)


def copy_threads() -> int:
    return sum(t.name == "slurm-elastic-shard-copy" for t in threading.enumerate())


def main() -> None:
    case, rank, port, new_port, out_dir = sys.argv[1:]
    rank_i = int(rank)
    replicate, lost, newcomer, copy_steps = CASES[case]
    tmp = Path(out_dir)
    survivors = [r for r in range(WORLD) if r not in lost]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank_i, world_size=WORLD
    )
    net = build()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    config = FSDPConfig(build=build, shard_modules=lambda m: [m[0], m[2]], replicate=replicate)
    sharded = ShardedModel(config, net, opt)
    module = sharded.shard("cpu", WORLD)
    sharded.open_copies("gloo", LOCAL_WORLD, torch.device("cpu"))
    reference: dict[str, torch.Tensor] = {}
    for step in range(1, STEPS + 1):
        torch.manual_seed(100 + 10 * step + rank_i)
        module(torch.randn(4, 5)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step not in copy_steps:
            continue
        in_flight = case == "fsdp_copy_in_flight" and step == copy_steps[-1]
        if rank_i in lost and in_flight:
            continue  # frozen: these ranks never answer the copy of this step
        if rank_i in lost:  # the survivors' boundary returned before these even started
            wait_for([tmp / f"started{step}.{r}" for r in survivors])
        rest = {"progress": {"step": step}, "stateful": {}}
        sharded.take_copy(step, 0, rest)  # what the session does at that step boundary
        (tmp / f"started{step}.{rank_i}").touch()
        if not in_flight:
            reference = full_state(module, opt)
            sharded.wait_copy()  # done before the loss (a copy in flight is not used)
    if not copy_steps:
        reference = full_state(module, opt)
    dist.barrier()
    result: dict[str, Any] = {"rank": rank_i}
    out = Path(out_dir) / f"rank{rank_i}.json"
    if rank_i in lost:
        out.write_text(json.dumps({**result, "lost": True}))
        if case == "fsdp_copy_in_flight":  # frozen: the connections stay open meanwhile
            wait_for([tmp / f"released.{r}" for r in survivors])
        os._exit(0)  # no teardown: the survivors see a dead peer
    result["copy_threads_before"] = copy_threads()
    sharded.keep_shards(STEPS, 0, WORLD)  # what LiveWorld.recover does at the failure
    started = time.monotonic()
    sharded.release()
    result["release_s"] = time.monotonic() - started
    result["copy_threads_after"] = copy_threads()
    (tmp / f"released.{rank_i}").touch()
    dist.destroy_process_group()
    if rank_i == newcomer:
        sharded.forget_kept()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{new_port}",
        rank=survivors.index(rank_i),
        world_size=len(survivors),
    )
    try:
        recovered = sharded.recover()
        assert recovered is not None
        step, own = recovered
        result["recovered"] = [step, own if own is None or isinstance(own, str) else "copy"]
        if isinstance(own, dict):
            result["rest_progress"] = own["progress"]
            result["rest_has_model"] = sorted(own["stateful"]["_fsdp"]) == ["model", "optimizer"]
    except ShardsLostError as exc:
        out.write_text(json.dumps({**result, "lost_error": str(exc)}))
        return
    got = rebuilt_state(sharded)
    result["keys_equal"] = sorted(got) == sorted(reference)
    result["unequal"] = [k for k in reference if k in got and not torch.equal(got[k], reference[k])]
    result["lr"] = [g["lr"] for g in sharded.state_dict()["optimizer"]["param_groups"]]
    # the rebuilt state trains on in the new world's mesh
    module = sharded.shard("cpu", len(survivors))
    module(torch.randn(4, 5)).pow(2).mean().backward()
    opt.step()
    result["trained_on"] = all(torch.isfinite(p.full_tensor()).all() for p in module.parameters())
    dist.destroy_process_group()
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
