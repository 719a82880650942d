"""The soak in small (``bench/soak.py``): consecutive membership changes of one run,
nothing may leak (agent and worker memory, descriptors, threads, child processes, files
in the rendezvous and checkpoint directories, processes after the end).

Real agents and workers on this machine (no Slurm: Slurm only starts the agents; the
membership changes are the rendezvous' and the agent's). The restart path; the in-place
path runs with ``bench/soak.py --path in-place`` once issue #11 is merged.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from soak import Soak

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_soak_small(tmp_path: Path) -> None:
    rows = Soak(tmp_path, changes=4).run()
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
