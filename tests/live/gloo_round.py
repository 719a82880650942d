"""Real worker processes of one gloo round on this machine, as the agent would start them.

For the tests that put a real group through a failure (tests/live/test_peer_failure.py,
tests/live/test_failed_group.py) and for their worker scripts: the round's store hosted
here, one process per rank, each joining the way the loop joins in place.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from slurm_elastic.live import ElasticState, auth, roster
from slurm_elastic.live.world import LiveWorld

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Round:
    """The round's workers and where they log."""

    procs: list[subprocess.Popen[bytes]]
    port: int
    logs_dir: Path

    def logs(self) -> str:
        """Every worker's output, for a failing assertion."""
        return "\n".join(
            (self.logs_dir / f"worker{r}.log").read_text(errors="replace")
            for r in range(len(self.procs))
        )


@contextmanager
def gloo_round(tmp_path: Path, script: Path, ranks: int, *args: object) -> Iterator[Round]:
    """Host a round's store and start ``script RANK PORT *ARGS`` once per rank (logging to
    ``tmp_path/worker<RANK>.log``); at the end every worker still running is killed."""
    port = free_port()
    master = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, use_libuv=True
    )  # the round's store, as the agent hosts it
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop(auth.KEY_FILE_ENV, None)
    procs = []
    try:
        for rank in range(ranks):
            log = open(tmp_path / f"worker{rank}.log", "wb")  # noqa: SIM115 - closed below
            argv = [sys.executable, str(script), str(rank), str(port), *map(str, args)]
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
            log.close()  # the child holds its own descriptor
        yield Round(procs, port, tmp_path)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        del master


def live_world(timeout_s: float) -> LiveWorld:
    """In a worker: a ``LiveWorld`` over a small model, in place but with no agent (no
    node channel: no stall guard, and no next round ever comes)."""
    return LiveWorld(
        ElasticState(torch.nn.Linear(4, 4), step=0),
        backend="gloo",
        ddp_kwargs={},
        timeout=timedelta(seconds=timeout_s),
        reform_timeout_s=1,
        in_place=True,
    )


def assignment(rank: int, ranks: int, port: int) -> roster.Assignment:
    """This worker's seat in round 1 (one worker per node), the store at ``port``."""
    return roster.Assignment(1, rank, ranks, 0, rank, ranks, "127.0.0.1", port)
