"""Contract of torch's agent: every protected ``LocalElasticAgent`` member SlurmElasticAgent
overrides, calls or reads, pinned so that a torch release that renames one, changes its
signature or changes the restart accounting fails here (not in a user's job).

Runs on each supported torch (scripts/test.sh runs tests/agent on 2.13.0 and 2.14.1).
The behaviour tests drive torch's own ``_invoke_run`` loop with the worker side replaced
at its seam (monitor/restart/stop record calls instead of running processes): what is
pinned is torch's loop, not workers.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import pytest
from torch.distributed.elastic.agent.server.api import (
    RunResult,
    SimpleElasticAgent,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

from slurm_elastic.agent.elastic_agent import SlurmElasticAgent
from tests.agent.idle_handler import IdleHandler

# name -> the parameters (after self) torch's method has; SlurmElasticAgent overrides
# these and calls super() with the same arguments.
OVERRIDDEN = {
    "_rendezvous": ["worker_group"],
    "_assign_worker_ranks": ["store", "group_rank", "group_world_size", "spec"],
    "_initialize_workers": ["worker_group"],
    "_start_workers": ["worker_group"],
    "_monitor_workers": ["worker_group"],
    "_restart_workers": ["worker_group"],
}
CALLED = {"_stop_workers": ["worker_group"], "_invoke_run": ["role"]}


def params(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)[1:]


@pytest.mark.parametrize("name", sorted(OVERRIDDEN))
def test_each_overridden_hook_exists_in_torch_with_our_signature(name: str) -> None:
    theirs = getattr(LocalElasticAgent, name)
    assert params(theirs) == OVERRIDDEN[name], f"torch changed {name}{inspect.signature(theirs)}"
    assert params(getattr(SlurmElasticAgent, name)) == OVERRIDDEN[name]
    assert name in SlurmElasticAgent.__dict__  # ours really overrides it


@pytest.mark.parametrize("name", sorted(CALLED))
def test_each_called_hook_exists_in_torch_with_the_expected_signature(name: str) -> None:
    assert params(getattr(LocalElasticAgent, name)) == CALLED[name]
    assert name not in SlurmElasticAgent.__dict__  # torch's own, not a copy


def agent(max_restarts: int, states: list[WorkerState], waiting: list[int]) -> Any:
    """A real LocalElasticAgent whose worker side is replaced at the seam."""
    spec = WorkerSpec(
        role="trainer",
        local_world_size=1,
        rdzv_handler=IdleHandler(waiting),
        entrypoint="true",
        max_restarts=max_restarts,
        monitor_interval=0.001,
    )

    calls: list[tuple[str, int]] = []

    class Seam(LocalElasticAgent):
        def _initialize_workers(self, worker_group: WorkerGroup) -> None:
            worker_group.state = WorkerState.HEALTHY

        def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
            return RunResult(state=states.pop(0))

        def _restart_workers(self, worker_group: WorkerGroup) -> None:
            calls.append(("restart", self._remaining_restarts))
            worker_group.state = WorkerState.HEALTHY

        def _stop_workers(self, worker_group: WorkerGroup) -> None:
            calls.append(("stop", self._remaining_restarts))

        def _exit_barrier(self) -> None:
            calls.append(("exit_barrier", self._remaining_restarts))

    seam = Seam(spec=spec, logs_specs=DefaultLogsSpecs(log_dir=os.devnull))  # no directory
    seam.calls = calls
    return seam


def test_the_restart_budget_and_the_attributes_we_read_are_torchs() -> None:
    a = agent(3, [], [])
    assert a._remaining_restarts == 3  # SlurmElasticAgent reads it (events), never writes
    assert isinstance(a._worker_group, WorkerGroup)  # read for the handler and workers
    assert a._pcontext is None  # before the first start; pids()/wait()/stdouts after
    from torch.distributed.elastic.multiprocessing.api import PContext

    for member in ("pids", "wait"):
        assert callable(getattr(PContext, member)), member
    assert "stdouts" in inspect.getsource(PContext.__init__)


def test_torch_charges_one_restart_before_calling_restart_workers_on_a_failure() -> None:
    """A FAILED result is charged by torch (SlurmElasticAgent returns FAILED only for a
    failure it charges)."""
    a = agent(2, [WorkerState.FAILED, WorkerState.FAILED, WorkerState.SUCCEEDED], [])
    result = a._invoke_run()
    assert result.state == WorkerState.SUCCEEDED
    assert a.calls == [("restart", 1), ("restart", 0), ("exit_barrier", 0)]


def test_torch_stops_without_restarting_when_the_budget_is_spent() -> None:
    """With the budget spent, a FAILED result stops the group."""
    a = agent(0, [WorkerState.FAILED], [])
    assert a._invoke_run().state == WorkerState.FAILED
    assert a.calls == [("stop", 0)]


def test_a_membership_change_is_a_restart_that_costs_no_budget() -> None:
    """SlurmElasticAgent reports a failure caused by a membership change as HEALTHY with
    num_nodes_waiting() > 0: torch restarts it without charging, even at zero budget."""
    a0 = agent(0, [WorkerState.HEALTHY, WorkerState.SUCCEEDED], [1])
    assert a0._invoke_run().state == WorkerState.SUCCEEDED
    assert a0.calls == [("restart", 0), ("exit_barrier", 0)]
    a = agent(1, [WorkerState.HEALTHY, WorkerState.SUCCEEDED], [2])
    assert a._invoke_run().state == WorkerState.SUCCEEDED
    assert a.calls == [("restart", 1), ("exit_barrier", 1)]


def test_our_agent_keeps_torchs_loop() -> None:
    assert SlurmElasticAgent._invoke_run is SimpleElasticAgent._invoke_run


def test_the_round_of_torchs_own_handlers_is_read_where_we_expect_it() -> None:
    """``_dynamic_handler_round`` reads torch's c10d/etcd handler state (private, the one
    read of its kind, in the agent): pinned here on a real c10d handler."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    from slurm_elastic.agent.elastic_agent import _dynamic_handler_round

    store = dist.HashStore()
    params = RendezvousParameters("c10d", "localhost:0", "contract", 1, 1, join_timeout="30")
    handler = create_handler(store, C10dRendezvousBackend(store, "contract"), params)
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert _dynamic_handler_round(handler) == 0
        handler.set_closed()
        assert isinstance(_dynamic_handler_round(handler), int)
    finally:
        handler.shutdown()
    assert _dynamic_handler_round(object()) is None  # anything else: no round
