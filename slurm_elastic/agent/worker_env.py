"""What the agent hands its workers: the command line and the environment.

Besides torch's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), each worker gets
:data:`WORKER_ENV`: the run's id and directories, the requeue count, and the node-local
channel through which the agent and its workers talk (:mod:`slurm_elastic.channel`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence

from slurm_elastic import envvars
from slurm_elastic.channel import NodeChannel
from slurm_elastic.config import ElasticConfig
from slurm_elastic.live import roster
from slurm_elastic.slurm.env import SlurmEnv

__all__ = ["WORKER_ENV", "python_entrypoint", "thread_environment", "worker_environment"]

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


def thread_environment(
    config: ElasticConfig, slurm: SlurmEnv, environ: Mapping[str, str]
) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for the workers when ``environ`` has none (else nothing).

    torchrun sets 1 when several workers share a node; we know the node's CPUs from
    Slurm, so each worker gets its share (torch would otherwise size its thread pools by
    the whole machine, not by the allocation). Read at ``import torch``: the warm
    interpreters (:mod:`.warm_workers`) start with it.
    """
    if "OMP_NUM_THREADS" in environ:
        return {}
    nproc = config.nproc_per_node or 1
    cpus = slurm.cpus_on_node or os.cpu_count() or 1
    return {"OMP_NUM_THREADS": str(max(1, cpus // nproc))}


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
    threads = thread_environment(config, slurm, os.environ)
    if threads:
        log.info(
            "OMP_NUM_THREADS unset: %s per worker (%s CPUs / %s workers)",
            threads["OMP_NUM_THREADS"],
            slurm.cpus_on_node or os.cpu_count() or 1,
            config.nproc_per_node or 1,
        )
    values.update(threads)
    return {k: str(v) for k, v in values.items() if v is not None}
