"""One process of tests/live/test_group_name.py (run as a script, not collected).

Usage: group_name_worker.py PORT survivor|newcomer
``survivor``: its first formation (round 1, 2 ranks, nobody else comes) fails; then it
forms round 2 as rank 0. ``newcomer``: a fresh process, forms round 2 as rank 1. Both
all-reduce a one and print ``SUM <value>``; the store is the test's.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from slurm_elastic.live.world import form_group


def main() -> None:
    port, role = int(sys.argv[1]), sys.argv[2]
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    if role == "survivor":
        try:
            form_group("gloo", dist.PrefixStore("round1", client), 0, 2, timedelta(seconds=2))
        except Exception as exc:  # the peer never came: the round is superseded
            print(f"FIRST_FAILED {type(exc).__name__}", flush=True)
        else:
            raise SystemExit("round 1 formed without its second rank")
    rank = 0 if role == "survivor" else 1
    form_group("gloo", dist.PrefixStore("round2", client), rank, 2, timedelta(seconds=20))
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"SUM {t.item()}", flush=True)
    dist.destroy_process_group()
    os._exit(0)  # torch's teardown at exit is not under test (docs/live.md, Limits)


if __name__ == "__main__":
    main()
