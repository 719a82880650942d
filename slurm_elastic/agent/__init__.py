"""The per-node agent: one per Slurm node (an srun task or an array task).

Contract: :func:`run_agent` joins the run's rendezvous (``min_nodes..max_nodes``), starts
``nproc_per_node`` workers with torch's environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``...) plus ours (:data:`~slurm_elastic.agent.worker_env.WORKER_ENV`), restarts
them on failure (``max_restarts``, membership changes free), on a hang
(``hang_timeout_s``) and when nodes join or leave, and on a preemption notice lets them
checkpoint, leaves the rendezvous and requeues only its own job or array task. The
process exit status is an :class:`ExitCode`.

Importing this package is cheap: :func:`run_agent` and :func:`rendezvous_parameters`
import torch when first used (the agent starts its workers' interpreters before that:
:mod:`.warm_workers`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from slurm_elastic.agent.exit_codes import ExitCode

if TYPE_CHECKING:
    from slurm_elastic.agent.launch import run_agent
    from slurm_elastic.agent.rendezvous_params import rendezvous_parameters
    from slurm_elastic.agent.worker_env import WORKER_ENV

__all__ = ["WORKER_ENV", "ExitCode", "rendezvous_parameters", "run_agent"]


def __getattr__(name: str) -> Any:
    if name == "run_agent":
        from slurm_elastic.agent.launch import run_agent

        return run_agent
    if name == "rendezvous_parameters":
        from slurm_elastic.agent.rendezvous_params import rendezvous_parameters

        return rendezvous_parameters
    if name == "WORKER_ENV":
        from slurm_elastic.agent.worker_env import WORKER_ENV

        return WORKER_ENV
    raise AttributeError(f"module 'slurm_elastic.agent' has no attribute {name!r}")
