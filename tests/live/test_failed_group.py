"""A failed gloo group is ended at once, whatever else it still runs.

Seen on the real Slurm (the array fault matrix: a frozen node, a cut-off node): a
survivor's step failed because the *other* survivor shut its connections down (its stall
guard), while the vote cast at the step's entry still waited, on gloo's other thread, for
the silent node. Re-forming dropped the failed group; its destructor joined that thread
holding the GIL, so the worker hung for the group's whole ``timeout_s`` and its peers
with it. :meth:`LiveWorld.recover` now shuts the failed group's connections down first
(:func:`slurm_elastic.live.links.abandon`).

Real processes, a real gloo group over a real TCPStore (tests/live/failed_group_worker.py).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.live.gloo_round import gloo_round

WORKER = Path(__file__).with_name("failed_group_worker.py")
TIMEOUT_S = 60  # the group's collective timeout: what the survivor must not wait out

pytestmark = pytest.mark.timeout(240)


def test_a_failed_group_with_a_collective_waiting_on_a_silent_peer_ends_at_once(
    tmp_path: Path,
) -> None:
    with gloo_round(tmp_path, WORKER, 3, TIMEOUT_S, tmp_path) as workers:
        procs = workers.procs

        def entered() -> bool:
            assert all(p.poll() is None for p in procs), workers.logs()
            return all((tmp_path / f"entered{r}").exists() for r in (1, 2))

        wait_for(entered, 120, "ranks 1 and 2 in their collectives")
        procs[2].send_signal(signal.SIGKILL)
        # Rank 1 must be done well inside the group's timeout (it waited all of it before).
        assert procs[1].wait(TIMEOUT_S - 10) == 0, workers.logs()
        result = json.loads((tmp_path / "result.json").read_text())
    # the broadcast failed as a lost peer's collective does, and the loop recovered
    assert result["type"] == "RuntimeError" and result["peer_failure"], result
    assert result["raised"] == "ReformTimeoutError", result  # no agent: no next round
    # the vote waited for the silent rank 0 when the step failed, and ended (failed) at
    # once after the recovery, not at the group's timeout
    assert result["vote_waiting"], result
    assert result["vote_failed"] and result["vote_ended_s"] < 5, result
