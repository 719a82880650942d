"""``SlurmElasticAgent``: torch's ``LocalElasticAgent`` with the reactions Slurm jobs need.

Torch's monitor loop (``SimpleElasticAgent._invoke_run``) is kept, with four changes:

1. **Membership changes are not failures.** When workers fail because a peer node left
   (preempted, evicted) the gloo/NCCL collectives of the survivors fail too; torch would
   charge that to ``max_restarts``. Here a restart whose new round has a different world
   size than the round that failed is refunded, so the budget counts real failures only.
2. **Hung workers are failures.** With ``hang_timeout_s`` set, a worker group whose
   progress reports (``slurm_elastic.notice.report_progress``) stop for that long after
   the first one is restarted, instead of sitting in a collective for the 30-minute
   default timeout.
3. **A departing peer is not a failure either**: with no restarts left, a failed group
   waits up to the eviction window for the rendezvous to report a membership change
   before giving up.
4. **Events**: rendezvous results, restarts and hangs are emitted as structured events.

Everything else (rank assignment, worker start/stop, the exit barrier, signal forwarding)
is torch's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from slurm_elastic import events

__all__ = ["SlurmElasticAgent"]

log = logging.getLogger(__name__)


class SlurmElasticAgent(LocalElasticAgent):
    """A per-node elastic agent.

    Args:
        membership_grace_s: with no restarts left, how long a failed group waits for the
            rendezvous to report a membership change (a peer that left or was evicted)
            before giving up; a failure caused by a departing peer is not this node's.
        progress_age_s: returns the seconds since the workers last reported progress (or
            since they started, if they never did); only consulted when ``hang_timeout_s``
            is set.
        hang_timeout_s: restart the group after this long without progress; ``None`` = off.
        before_round: called before each rendezvous round and (re)start of the local
            workers, once the previous ones are stopped (the launcher clears the
            per-round notice and progress files there).
        kwargs: passed to :class:`LocalElasticAgent`.
    """

    def __init__(
        self,
        *,
        membership_grace_s: float,
        progress_age_s: Callable[[], float],
        hang_timeout_s: float | None,
        before_round: Callable[[WorkerGroup], None],
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._membership_grace_s = membership_grace_s
        self._progress_age_s = progress_age_s
        self._hang_timeout_s = hang_timeout_s
        self._before_round = before_round

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        self._before_round(worker_group)
        super()._initialize_workers(worker_group)
        nodes = worker_group.group_world_size or 0
        world = nodes * worker_group.spec.local_world_size
        log.info(
            "rendezvous complete: group_rank=%s group_world_size=%s world_size=%s",
            worker_group.group_rank,
            nodes,
            world,
        )
        events.emit(
            events.WorkersStarted(
                group_rank=worker_group.group_rank,
                group_world_size=nodes,
                world_size=world,
                restart_count=worker_group.spec.max_restarts - self._remaining_restarts,
                logs=self._worker_logs(worker_group),
            )
        )

    def _worker_logs(self, worker_group: WorkerGroup) -> dict[str, str]:
        """Global rank -> the worker's stdout file (for ``slurm-elastic logs``)."""
        stdouts = getattr(self._pcontext, "stdouts", None) or {}
        return {
            str(w.global_rank): str(stdouts[w.local_rank])
            for w in worker_group.workers
            if stdouts.get(w.local_rank)
        }

    def _restart_after(self, reason: str, charge: bool) -> None:
        group = self._worker_group
        before = group.group_world_size
        if charge:
            self._remaining_restarts -= 1
        events.emit(events.AgentRestart(reason=reason, remaining_restarts=self._remaining_restarts))
        self._restart_workers(group)
        if charge and group.group_world_size != before:
            # The failure came with a membership change (a peer left or joined): the
            # survivors' collectives fail through no fault of their own. Refund it.
            self._remaining_restarts += 1
            log.info(
                "world changed %s -> %s nodes: restart not charged to max_restarts",
                before,
                group.group_world_size,
            )

    def _invoke_run(self, role: str = "default") -> RunResult:
        spec = self._worker_group.spec
        self._initialize_workers(self._worker_group)
        while True:
            time.sleep(spec.monitor_interval)
            run_result = self._monitor_workers(self._worker_group)
            state = run_result.state
            if state == WorkerState.HEALTHY and self._is_hung():
                log.warning(
                    "no training progress for %.1f s (hang_timeout_s=%s): restarting workers",
                    self._progress_age_s(),
                    self._hang_timeout_s,
                )
                events.emit(events.AgentHang(progress_age_s=self._progress_age_s()))
                state = WorkerState.UNHEALTHY
            self._worker_group.state = state

            if state == WorkerState.SUCCEEDED:
                log.info("local workers finished; waiting for the other agents")
                events.emit(events.WorkersSucceeded())
                self._exit_barrier()
                return run_result
            if state in (WorkerState.UNHEALTHY, WorkerState.FAILED):
                if self._remaining_restarts > 0:
                    log.info(
                        "worker group %s; %s/%s restarts left: restarting",
                        state.name,
                        self._remaining_restarts,
                        spec.max_restarts,
                    )
                    self._restart_after(state.name.lower(), charge=True)
                    continue
                if self._membership_changes_within(self._membership_grace_s):
                    log.info(
                        "worker group %s while a peer left: new round (not charged)", state.name
                    )
                    self._restart_after("membership", charge=False)
                    continue
                self._stop_workers(self._worker_group)
                self._worker_group.state = WorkerState.FAILED
                events.emit(events.AgentGaveUp(max_restarts=spec.max_restarts))
                if state == WorkerState.UNHEALTHY:
                    # torch reports no failures for a hang; make it a failed result.
                    run_result = RunResult(state=WorkerState.FAILED)
                return run_result
            if state == WorkerState.HEALTHY:
                waiting = spec.rdzv_handler.num_nodes_waiting()
                if waiting > 0:
                    log.info("%s node(s) waiting or membership changed: new round", waiting)
                    self._restart_after("membership", charge=False)
            else:
                raise RuntimeError(f"worker group in unexpected state {state.name}")

    def _membership_changes_within(self, seconds: float) -> bool:
        handler = self._worker_group.spec.rdzv_handler
        deadline = time.monotonic() + seconds
        while True:
            if handler.num_nodes_waiting() > 0:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.2, seconds))

    def _is_hung(self) -> bool:
        return self._hang_timeout_s is not None and self._progress_age_s() > self._hang_timeout_s
