"""The per-node agent: one per Slurm node (an srun task or an array task).

Contract: :func:`run_agent` joins the run's rendezvous (``min_nodes..max_nodes``), starts
``nproc_per_node`` workers with torch's environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``...) plus ours (:data:`~slurm_elastic.agent.worker_env.WORKER_ENV`), restarts
them on failure (``max_restarts``, membership changes free), on a hang
(``hang_timeout_s``) and when nodes join or leave, and on a preemption notice lets them
checkpoint, leaves the rendezvous and requeues only its own job or array task. The
process exit status is an :class:`ExitCode`.

Importing this package imports torch; ``slurm_elastic`` itself does not.
"""

from slurm_elastic.agent.exit_codes import ExitCode
from slurm_elastic.agent.launch import run_agent
from slurm_elastic.agent.rendezvous_params import rendezvous_parameters
from slurm_elastic.agent.worker_env import WORKER_ENV

__all__ = ["WORKER_ENV", "ExitCode", "rendezvous_parameters", "run_agent"]
