"""One rank of tests/live/test_buried_group.py (run as a script, not collected).

Usage: buried_group_worker.py PORT RANK DONE_FILE
Both ranks form a 2-rank gloo group (timeout 20 s). Rank 1 then stays silent (it never
joins the collective) until DONE_FILE exists. Rank 0 starts an ``all_reduce`` that
therefore waits on gloo's thread, tears its group down as after a failure
(``LiveWorld.teardown(failed=True)``) and prints ``TOOK <seconds>``.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from slurm_elastic.live import ElasticState
from slurm_elastic.live.world import LiveWorld, form_group


def main() -> None:
    port, rank, done = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    form_group("gloo", dist.PrefixStore("g", client), rank, 2, timedelta(seconds=20))
    print("FORMED", flush=True)
    if rank == 1:
        while not done.exists():
            time.sleep(0.05)
        os._exit(0)
    live = LiveWorld(
        ElasticState(torch.nn.Linear(1, 1)),
        backend="gloo",
        ddp_kwargs={},
        timeout=timedelta(seconds=20),
        reform_timeout_s=5.0,
        in_place=False,
        stall_abort_s=None,
    )
    flags = torch.ones(1)  # referenced to the end: only the group is under test here
    work = dist.all_reduce(flags, async_op=True)  # rank 1 never joins it
    del work
    time.sleep(0.5)  # on gloo's thread, waiting for rank 1
    started = time.monotonic()
    live.teardown(failed=True)  # the last reference to the group goes in here
    print(f"TOOK {time.monotonic() - started:.3f}", flush=True)
    os._exit(0)  # the buried group's release is not under test here (prune: units)


if __name__ == "__main__":
    main()
