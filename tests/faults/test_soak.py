"""The soak in small (``bench/soak.py``): consecutive membership changes of one run,
nothing may leak (agent and worker memory, descriptors, threads, child processes, files
in the rendezvous and checkpoint directories, processes after the end).

Real agents and workers on this machine (no Slurm: Slurm only starts the agents; the
membership changes are the rendezvous' and the agent's). Both paths: in place (the
example's default) and restart (``SLURM_ELASTIC_IN_PLACE=0``); each asserts which one
happened (one worker process in place, a new one per change on restart).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from soak import Soak

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize("path", ["in-place", "restart"])
def test_soak_small(tmp_path: Path, path: str) -> None:
    rows = Soak(tmp_path, changes=4, path=path).run()
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
