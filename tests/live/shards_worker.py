"""One rank of tests/live/test_fsdp_shards.py: a real gloo group of 4 trains a small model
under FSDP2/HSDP, some ranks die (``os._exit``: their sockets close, nothing is
gathered), and the survivors rebuild the full state from their shards in a new group.

Usage: shards_worker.py CASE RANK PORT NEW_PORT OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
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
# joins the new world as a newcomer would (or None), the step of a neighbour copy (or 0))
CASES: dict[str, tuple[int, tuple[int, ...], int | None, int]] = {
    "hsdp_replica_lost": (2, (2, 3), None, 0),
    "hsdp_one_rank_lost_and_a_newcomer": (2, (3,), 2, 0),
    "fsdp_shards_lost": (1, (2, 3), None, 0),
    "fsdp_neighbour_copy": (1, (2, 3), None, 2),
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


def main() -> None:
    case, rank, port, new_port, out_dir = sys.argv[1:]
    rank_i = int(rank)
    replicate, lost, newcomer, copy_at = CASES[case]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank_i, world_size=WORLD
    )
    net = build()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    config = FSDPConfig(build=build, shard_modules=lambda m: [m[0], m[2]], replicate=replicate)
    sharded = ShardedModel(config, net, opt)
    module = sharded.shard("cpu", WORLD)
    reference: dict[str, torch.Tensor] = {}
    for step in range(1, STEPS + 1):
        torch.manual_seed(100 + 10 * step + rank_i)
        module(torch.randn(4, 5)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step == copy_at:  # what the session does at that step boundary
            rest = {"progress": {"step": step}, "stateful": {}}
            sharded.take_copy(step, 0, rest, LOCAL_WORLD, torch.device("cpu"))
            reference = full_state(module, opt)
    if not copy_at:
        reference = full_state(module, opt)
    dist.barrier()
    result: dict[str, Any] = {"rank": rank_i}
    out = Path(out_dir) / f"rank{rank_i}.json"
    if rank_i in lost:
        out.write_text(json.dumps({**result, "lost": True}))
        os._exit(0)  # no teardown: the survivors see a dead peer
    sharded.keep_shards(STEPS, 0, WORLD)  # what LiveWorld.recover does at the failure
    sharded.release()
    dist.destroy_process_group()
    if rank_i == newcomer:
        sharded.forget_kept()
    survivors = [r for r in range(WORLD) if r not in lost]
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
