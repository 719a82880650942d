"""A training-like worker: gloo all_reduce steps, one JSON record per step.

Args: OUT_DIR. Stops (exit 0) once OUT_DIR/stop exists. Exits 1 if a collective fails
or returns a wrong sum (the agent then restarts the worker group).
"""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)
out = Path(sys.argv[1])
dist.init_process_group("gloo", timeout=timedelta(seconds=20))
rank, world = dist.get_rank(), dist.get_world_size()
step = 0
while True:
    t = torch.ones(1)
    dist.all_reduce(t)
    ok = int(t.item()) == world
    rec = {
        "rank": rank,
        "world": world,
        "group_rank": int(os.environ["GROUP_RANK"]),
        "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
        "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        "agent_pid": os.getppid(),
        "pid": os.getpid(),
        "step": step,
        "ok": ok,
    }
    fd = os.open(out / "records.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.write(fd, (json.dumps(rec) + "\n").encode())
    os.close(fd)
    if not ok:
        sys.exit(1)
    # Decide together, so that all ranks stop after the same step.
    flag = torch.tensor([1.0 if (out / "stop").exists() else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:
        break
    step += 1
    time.sleep(0.2)
dist.destroy_process_group()
