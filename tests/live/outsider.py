"""The outsider of tests/live/test_store_auth.py: another local user who reaches the
round's store. Started by root, it imports torch, then drops to that user's uid and gid
for good (setgroups/setgid/setuid) before it touches anything of the job.

Usage: outsider.py UID GID PORT ROUND KEY_FILE DROP_DIR. Reports in DROP_DIR: ``key``
(what reading the run key gave) and ``seated`` (only if it got into a group).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from slurm_elastic.live import auth


def main() -> None:
    uid, gid, port, round_ = (int(v) for v in sys.argv[1:5])
    key_file, drop = Path(sys.argv[5]), Path(sys.argv[6])
    # Everything torch loads lazily, loaded now: after the drop the interpreter's own
    # files may be unreadable (a Python under /root).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.all_reduce(torch.zeros(1))
    dist.destroy_process_group()
    os.setgroups([gid])
    os.setgid(gid)
    os.setuid(uid)
    assert os.geteuid() == uid and os.getuid() == uid
    try:
        auth.load_key(key_file)
        (drop / "key").write_text("read")
    except OSError as exc:
        (drop / "key").write_text(type(exc).__name__)
    client = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20), use_libuv=True
    )
    namespace = dist.PrefixStore(f"slurm_elastic.live.{round_}", client)
    namespace.set("ready/0", "1")
    dist.init_process_group(  # the seat of rank 0, before the real rank 0
        "gloo",
        store=dist.PrefixStore("pg", namespace),
        rank=0,
        world_size=3,
        timeout=timedelta(seconds=20),
    )
    t = torch.tensor([100.0])
    dist.all_reduce(t)
    (drop / "seated").write_text(str(t.item()))


if __name__ == "__main__":
    main()
