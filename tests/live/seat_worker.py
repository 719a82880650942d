"""One real worker of a round, joined the way ElasticLoop joins in place (LiveWorld's own
store connection and group init), for tests/live/test_store_auth.py.

Usage: seat_worker.py RANK WORLD PORT ROUND OUT_FILE (the run key file in
SLURM_ELASTIC_KEY_FILE). Contributes ``rank + 1`` to an all-reduce and writes the sum.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from slurm_elastic.live import ElasticState, roster
from slurm_elastic.live.world import LiveWorld


def main() -> None:
    rank, world, port, round_, out = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
        Path(sys.argv[5]),
    )
    live = LiveWorld(
        ElasticState(torch.nn.Linear(1, 1)),
        backend="gloo",
        ddp_kwargs={},
        timeout=timedelta(seconds=90),  # the real rank 0 starts late, on purpose
        reform_timeout_s=30,
        in_place=True,
    )
    a = roster.Assignment(round_, rank, world, 0, rank, world, "127.0.0.1", port)
    live._join(a, live._connect(a))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out.write_text(str(t.item()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
