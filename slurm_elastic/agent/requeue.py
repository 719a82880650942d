"""What the agent asks of Slurm as its node leaves the run: requeue its own job or array
task (after a preemption notice, or a failure with ``requeue="always"``), or, once the run
has finished, cancel the array's still-pending tasks so nothing of the job stays queued.

Only ever the agent's own job or task: the other nodes decide for themselves.
"""

from __future__ import annotations

import logging

from slurm_elastic import events
from slurm_elastic.config import ElasticConfig
from slurm_elastic.errors import SlurmError
from slurm_elastic.slurm.control import SlurmControl, default_control
from slurm_elastic.slurm.env import SlurmEnv

__all__ = ["cancel_pending_tasks", "requeue_own"]

log = logging.getLogger(__name__)


def _client(client: SlurmControl | None) -> SlurmControl:
    return client if client is not None else default_control()


def requeue_own(
    config: ElasticConfig, slurm: SlurmEnv, client: SlurmControl | None
) -> bool | SlurmError:
    """Requeue this node's own job or array task.

    Returns:
        True: requeued. False: not to be requeued (not in Slurm, ``max_requeues``
        reached). The :class:`SlurmError` of a requeue that failed (no ``scontrol`` on
        PATH, Slurm refused): only Slurm's own requeue can bring the task back.
    """
    ref = slurm.own_job_ref
    if ref is None:
        log.info("not in a Slurm job: nothing to requeue")
        return False
    if slurm.restart_count >= config.max_requeues:
        log.warning(
            "not requeueing %s: requeued %d times already (max_requeues=%d)",
            ref,
            slurm.restart_count,
            config.max_requeues,
        )
        return False
    try:
        _client(client).requeue(ref)
    except SlurmError as exc:
        # Slurm may be requeueing the job itself (PreemptMode=REQUEUE) at the same time;
        # the caller says what follows.
        return exc
    log.info("requeued %s", ref)
    events.emit(events.AgentRequeued(job=ref, requeue_count=slurm.restart_count + 1))
    return True


def cancel_pending_tasks(slurm: SlurmEnv, client: SlurmControl | None) -> None:
    """After success, nothing of the array may stay queued (requeued or never started)."""
    if not slurm.is_array_task or slurm.array_job_id is None:
        return
    try:
        _client(client).cancel(slurm.array_job_id, state="PENDING")
    except SlurmError as exc:
        log.warning("could not cancel the pending tasks of %s: %s", slurm.array_job_id, exc)
