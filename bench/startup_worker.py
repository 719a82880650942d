"""Worker of bench/startup.py: one DDP training step, then rank 0 records when it finished.

Usage (under ``slurm-elastic agent`` or ``torchrun``): ``startup_worker.py OUT_DIR``.
Rank 0 writes ``OUT_DIR/first_step.json`` with wall-clock timestamps of its milestones
(process start, torch imported, process group up, step 1 done); every rank exits 0.
"""

import time

T_PROCESS = time.time()  # before anything else: the worker process exists

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

T_IMPORTED = time.time()


def main() -> int:
    out = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    t_group = time.time()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    t_step = time.time()
    if dist.get_rank() == 0:
        record = {
            "process": T_PROCESS,
            "imported": T_IMPORTED,
            "group": t_group,
            "first_step": t_step,
            "world_size": dist.get_world_size(),
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        }
        tmp = os.path.join(out, "first_step.json.tmp")
        with open(tmp, "w") as fh:
            json.dump(record, fh)
        os.replace(tmp, os.path.join(out, "first_step.json"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
