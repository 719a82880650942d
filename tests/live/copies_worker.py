"""One of two ranks of tests/live/test_fsdp_shards.py's swap tests: a real gloo group of
2 swaps values with slurm_elastic.live.copies.swap on a group of its own.

Usage: copies_worker.py CASE RANK PORT OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slurm_elastic.errors import StateExchangeError
from slurm_elastic.live.copies import swap


def main() -> None:
    case, rank, port, out_dir = sys.argv[1:]
    me = int(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=me, world_size=2)
    group = dist.new_group(backend="gloo")
    value = {"w": torch.arange(6.0).reshape(2, 3) + me, "step": me, "name": f"rank{me}"}
    limit, step = 1 << 20, 5
    if case == "over_limit" and me == 0:
        limit = 100  # rank 1's piece is bigger
    if case == "other_step" and me == 1:
        step = 4
    seen: list[Any] = []
    result: dict[str, Any] = {"rank": me}
    try:
        got = swap(value, 1 - me, 1 - me, limit, "cpu", group=group, step=step, check=seen.append)
        result["got"] = {"w": got["w"].tolist(), "step": got["step"], "name": got["name"]}
        result["spec"] = repr(seen[0]["w"])
    except StateExchangeError as exc:
        result["refused"] = str(exc)
    except RuntimeError as exc:  # the refuser exited: its connections closed
        result["peer_gone"] = str(exc)[:200]
    Path(out_dir, f"rank{me}.json").write_text(json.dumps(result))
    os._exit(0)  # the peer of a refusal may still wait on this rank's bytes


if __name__ == "__main__":
    main()
