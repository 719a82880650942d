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
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from slurm_elastic.live import auth
from tests.helpers import wait_for
from tests.live.test_peer_failure import free_port

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("failed_group_worker.py")
TIMEOUT_S = 60  # the group's collective timeout: what the survivor must not wait out

pytestmark = pytest.mark.timeout(240)


def test_a_failed_group_with_a_collective_waiting_on_a_silent_peer_ends_at_once(
    tmp_path: Path,
) -> None:
    port = free_port()
    master = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, use_libuv=True
    )  # the round's store, as the agent hosts it
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop(auth.KEY_FILE_ENV, None)
    procs = []
    for rank in range(3):
        log = open(tmp_path / f"worker{rank}.log", "wb")  # noqa: SIM115 - closed with the test
        argv = [sys.executable, str(WORKER), str(rank), str(port), str(TIMEOUT_S), str(tmp_path)]
        procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))

    def logs() -> str:
        return "\n".join(
            (tmp_path / f"worker{r}.log").read_text(errors="replace") for r in range(3)
        )

    try:

        def entered() -> bool:
            assert all(p.poll() is None for p in procs), logs()
            return all((tmp_path / f"entered{r}").exists() for r in (1, 2))

        wait_for(entered, 120, "ranks 1 and 2 in their collectives")
        procs[2].send_signal(signal.SIGKILL)
        # Rank 1 must be done well inside the group's timeout (it waited all of it before).
        assert procs[1].wait(TIMEOUT_S - 10) == 0, logs()
        result = json.loads((tmp_path / "result.json").read_text())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        del master
    # the broadcast failed as a lost peer's collective does, and the loop recovered
    assert result["type"] == "RuntimeError" and result["peer_failure"], result
    assert result["raised"] == "ReformTimeoutError", result  # no agent: no next round
    # the vote waited for the silent rank 0 when the step failed, and ended (failed) at
    # once after the recovery, not at the group's timeout
    assert result["vote_waiting"], result
    assert result["vote_failed"] and result["vote_ended_s"] < 5, result
