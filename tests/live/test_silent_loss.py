"""A node that dies silently (frozen: SIGSTOP of its agent and workers, sockets open).

No socket is reset, so gloo raises nothing: before ``slurm_elastic.live.abort`` the
survivors waited in their collective for ``timeout_s`` (300 s) although the rendezvous
had evicted the node after its liveness window. Now the survivors train again at N-1,
in the same processes, within the eviction window plus a few seconds, redoing only the
steps since their last in-memory commit; every sample is still used once per epoch.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from slurm_elastic.agent import ExitCode
from slurm_elastic.events import read_events
from tests.helpers import wait_for
from tests.live.conftest import (
    TOGETHER_LAST_CALL_S,
    LiveRun,
    assert_close_to_reference,
    assert_each_sample_once,
    ledger,
    redone_steps,
    steps_done,
    wait_world_of_4,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

# LiveRun's rendezvous: heartbeat_interval=0.5 s x heartbeat_miss_limit=3.
EVICTION_WINDOW_S = 0.5 * 3
# The bound the issue sets at default settings: the eviction window + 5 s.
BOUND_S = EVICTION_WINDOW_S + 5.0


@pytest.mark.parametrize("frozen", ["store_host", "other"])
def test_frozen_node_costs_survivors_at_most_the_eviction_window_plus_5s(
    tmp_path: Path, nodes: list[LiveRun], frozen: str
) -> None:
    steps = 400
    run_id = f"frozen-{frozen}"
    a = LiveRun(tmp_path, run_id, "1:2", "a", steps=steps, last_call_s=TOGETHER_LAST_CALL_S)
    b = LiveRun(tmp_path, run_id, "1:2", "b", steps=steps, last_call_s=TOGETHER_LAST_CALL_S)
    nodes += [a, b]
    wait_world_of_4(tmp_path, min_steps=20)
    # rank 0 (the node hosting the round's store) or the other one
    rank0_pid = next(r["pid"] for r in ledger(tmp_path) if r["world"] == 4 and r["rank"] == 0)
    a_is_host = rank0_pid in a.worker_pids()
    victim, survivor = (a, b) if a_is_host == (frozen == "store_host") else (b, a)
    survivor_pids = survivor.worker_pids()

    frozen_at = time.time()
    victim_pids = victim.freeze_node()
    frozen_step = steps_done(tmp_path)

    def first_step_at_n_minus_1() -> float | None:
        after = [r for r in ledger(tmp_path) if r["world"] == 2 and r["time"] > frozen_at]
        return min((r["time"] for r in after), default=None)

    # Wait longer than the bound, so a miss reports the time it took (or that no step
    # came at all: before the fix, the survivors waited for the 300 s collective timeout).
    first = wait_for(first_step_at_n_minus_1, BOUND_S + 25, "a step at N-1 after the freeze")
    took = first - frozen_at
    print(f"frozen {frozen}: first step at N-1 {took:.2f} s after the freeze")
    assert took <= BOUND_S, f"survivors stalled {took:.2f} s > window + 5 s = {BOUND_S} s"

    assert survivor.wait(150) == ExitCode.FINISHED, survivor.log()
    records = ledger(tmp_path)
    after = [r for r in records if r["time"] > first]
    # in place: the survivors' processes trained on, alone, in the world of 2
    assert after and {r["pid"] for r in after} == survivor_pids
    assert {r["world"] for r in after} == {2}
    assert not {r["pid"] for r in after} & victim_pids
    assert redone_steps(records) <= 2  # commit every step: at most the stalled step again
    assert_each_sample_once(records, steps)
    assert_close_to_reference(tmp_path, steps)
    kinds = [e["kind"] for e in read_events(tmp_path / "state" / "events" / run_id)]
    assert "live.collective_aborted" in kinds
    assert frozen_step < steps
