"""One Slurm task = one node: rendezvous "slurm", then a gloo all_reduce as a worker.

Args: ROOT OUT_DIR. Writes OUT_DIR/<SLURMD_NODENAME>.json. The run id, the requeue
identity and the advertised address all come from the SLURM_* environment.
"""

import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from slurm_elastic.rendezvous import create_handler

torch.set_num_threads(1)
root, out = sys.argv[1], Path(sys.argv[2])
nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
handler = create_handler(
    RendezvousParameters(
        "slurm", root, os.environ["SLURM_JOB_ID"], nodes, nodes,
        heartbeat_interval="0.5", last_call_timeout="1", join_timeout="120",
    )
)  # fmt: skip
info = handler.next_rendezvous()
si = info.bootstrap_store_info
store = dist.TCPStore(
    si.master_addr, si.master_port, is_master=False, timeout=timedelta(seconds=60)
)
dist.init_process_group("gloo", store=store, rank=info.rank, world_size=info.world_size)
t = torch.tensor([float(info.rank + 1)])
dist.all_reduce(t)
dist.barrier()
dist.destroy_process_group()
record = {
    "node": os.environ["SLURMD_NODENAME"],
    "hostname": socket.gethostname(),
    "rank": info.rank,
    "world": info.world_size,
    "store": f"{si.master_addr}:{si.master_port}",
    "sum": t.item(),
}
(out / f"{record['node']}.json").write_text(json.dumps(record))
handler.shutdown()
