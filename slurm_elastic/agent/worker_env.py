"""What the agent hands its workers: the command line and the environment.

Besides torch's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), each worker gets
:data:`WORKER_ENV`: the run's id and directories, the requeue count, and the node-local
channel through which the agent and its workers talk (:mod:`slurm_elastic.channel`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from slurm_elastic import envvars
from slurm_elastic.channel import NodeChannel
from slurm_elastic.config import ElasticConfig
from slurm_elastic.live import roster
from slurm_elastic.slurm.env import SlurmEnv

__all__ = ["WORKER_ENV", "python_entrypoint", "worker_environment"]

log = logging.getLogger(__name__)

#: Variables the agent adds to its workers' environment (besides torch's).
WORKER_ENV = (
    envvars.RUN_ID_ENV,
    envvars.CHECKPOINT_DIR_ENV,
    envvars.EVENTS_DIR_ENV,
    envvars.REQUEUE_COUNT_ENV,
    envvars.NODE_DIR_ENV,
    envvars.PREEMPT_SIGNAL_ENV,
    roster.ROUND_ENV,
)


def python_entrypoint(entrypoint: str, args: Sequence[str], module: bool) -> tuple[str, tuple]:
    """The worker's command: this interpreter, unbuffered, on a script or ``-m module``."""
    if module:
        return sys.executable, ("-u", "-m", entrypoint, *args)
    return sys.executable, ("-u", entrypoint, *args)


def worker_environment(
    config: ElasticConfig,
    slurm: SlurmEnv,
    channel: NodeChannel,
) -> dict[str, str]:
    """The variables to add to the agent's environment, which its workers inherit."""
    values: dict[str, object] = {
        envvars.RUN_ID_ENV: config.run_id,
        envvars.CHECKPOINT_DIR_ENV: config.checkpoint_dir,
        envvars.EVENTS_DIR_ENV: config.events_dir,
        envvars.REQUEUE_COUNT_ENV: slurm.restart_count,
        **channel.environment(),
        envvars.PREEMPT_SIGNAL_ENV: config.preempt_signal,
        # Our handlers own TERM/HUP/QUIT and the notice signal; torch's keeps SIGINT.
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGINT",
    }
    if "OMP_NUM_THREADS" not in os.environ:
        # torchrun sets 1 when several workers share a node; we know the node's CPUs from
        # Slurm, so give each worker its share (torch would otherwise size its thread
        # pools by the whole machine, not by the allocation).
        nproc = config.nproc_per_node or 1
        cpus = slurm.cpus_on_node or os.cpu_count() or 1
        values["OMP_NUM_THREADS"] = max(1, cpus // nproc)
        log.info(
            "OMP_NUM_THREADS unset: %s per worker (%s CPUs / %s workers)",
            values["OMP_NUM_THREADS"],
            cpus,
            nproc,
        )
    return {k: str(v) for k, v in values.items() if v is not None}
