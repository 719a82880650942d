"""One node's agent: torch's LocalElasticAgent via elastic_launch, rendezvous "slurm".

Args: ROOT RUN_ID MIN MAX OUT_DIR. Two workers running worker.py; fast rendezvous timeouts.
"""

import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

root, run_id, min_n, max_n, out = sys.argv[1:6]
config = LaunchConfig(
    min_nodes=int(min_n),
    max_nodes=int(max_n),
    nproc_per_node=2,
    run_id=run_id,
    rdzv_backend="slurm",
    rdzv_endpoint=root,
    rdzv_configs={
        "heartbeat_interval": "0.5",
        "heartbeat_miss_limit": "4",
        "last_call_timeout": "1",
        "join_timeout": "120",
    },
    max_restarts=5,
    monitor_interval=0.1,
    local_addr="127.0.0.1",
    # torch's default is a new torchelastic_* directory in /tmp that nothing removes
    logs_specs=DefaultLogsSpecs(log_dir=str(Path(out) / "torch-logs")),
)
worker = str(Path(__file__).with_name("worker.py"))
elastic_launch(config, sys.executable)(worker, out)
