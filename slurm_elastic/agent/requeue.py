"""What the agent asks of Slurm as its node leaves the run: requeue its own job or array
task (after a preemption notice, or a failure with ``requeue="always"``), or, once the run
has finished, cancel the array's still-pending tasks so nothing of the job stays queued.

Only ever the agent's own job or task: the other nodes decide for themselves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from slurm_elastic import events
from slurm_elastic.config import ElasticConfig
from slurm_elastic.errors import SlurmCommandError, SlurmControllerError, SlurmError
from slurm_elastic.slurm.control import SlurmControl, default_control
from slurm_elastic.slurm.env import SlurmEnv

__all__ = ["cancel_pending_tasks", "requeue_own"]

log = logging.getLogger(__name__)

#: How long after its first try the agent may still try to requeue its task again, when
#: Slurm's answer says slurmctld was busy or away (seconds), and the pauses between tries.
REQUEUE_RETRY_S = 30.0
_PAUSES_S = (1.0, 2.0, 4.0, 8.0)

#: Answers of a busy or briefly absent slurmctld (besides the unreachable controller of
#: :class:`SlurmControllerError`). Measured on Slurm 22.05 with slurmctld stopped past
#: ``MessageTimeout``: ``scontrol requeue`` exited 1 with "Unexpected message received"
#: after 10 s, and slurmctld carried the requeue out when it went on. So a failed try may
#: have taken effect: a later try that finds the task pending has succeeded.
_TRANSIENT = ("unexpected message received", "resource temporarily unavailable", "try again")
_PENDING = "job is pending execution"


def _client(client: SlurmControl | None) -> SlurmControl:
    return client if client is not None else default_control()


def requeue_own(
    config: ElasticConfig,
    slurm: SlurmEnv,
    client: SlurmControl | None,
    sleep: Callable[[float], None] = time.sleep,
) -> bool | SlurmError:
    """Requeue this node's own job or array task; a busy or briefly absent slurmctld is
    asked again, for up to :data:`REQUEUE_RETRY_S` after the first try.

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
    error = _requeue(_client(client), ref, sleep, time.monotonic)
    if error is not None:
        # Slurm may be requeueing the job itself (PreemptMode=REQUEUE) at the same time;
        # the caller says what follows.
        return error
    log.info("requeued %s", ref)
    events.emit(events.AgentRequeued(job=ref, requeue_count=slurm.restart_count + 1))
    return True


def _transient(exc: SlurmError) -> bool:
    if isinstance(exc, SlurmControllerError):
        return True
    text = str(exc).lower()
    return (
        isinstance(exc, SlurmCommandError)
        and exc.returncode is not None  # not our own timeout: that spent the time already
        and any(marker in text for marker in _TRANSIENT)
    )


def _requeue(
    client: SlurmControl, ref: str, sleep: Callable[[float], None], clock: Callable[[], float]
) -> SlurmError | None:
    """``scontrol requeue ref``, tried again after a transient failure: None when done."""
    start = clock()
    failed_before = False
    for pause in (*_PAUSES_S, None):
        try:
            client.requeue(ref)
            return None
        except SlurmError as exc:
            if failed_before and _PENDING in str(exc).lower():
                log.info("%s is pending: an earlier try took effect", ref)
                return None
            if pause is None or not _transient(exc) or clock() - start + pause > REQUEUE_RETRY_S:
                return exc
            log.warning("requeue of %s failed (%s); trying again in %.0f s", ref, exc, pause)
            failed_before = True
            sleep(pause)
    raise AssertionError("unreachable")  # pragma: no cover


def cancel_pending_tasks(slurm: SlurmEnv, client: SlurmControl | None) -> None:
    """After success, nothing of the array may stay queued (requeued or never started)."""
    if not slurm.is_array_task or slurm.array_job_id is None:
        return
    try:
        _client(client).cancel(slurm.array_job_id, state="PENDING")
    except SlurmError as exc:
        log.warning("could not cancel the pending tasks of %s: %s", slurm.array_job_id, exc)
