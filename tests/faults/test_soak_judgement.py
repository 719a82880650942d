"""How the soak (``bench/soak.py``) judges its samples: within one phase and one role.

Found in a 646-change run on the restart path (2026-12-06): agent A's descriptors were 26
in the first quarter and 37 in the last with B present, and nothing leaked. A hosts the
round's store (11 descriptors and a thread more) exactly when it is rank 0, the lowest pid
on the host, and pids wrap. Comparing samples of different roles judged that a leak.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from soak import HOSTS_STORE, WORLD, _phase_medians


def _sample(fds: float, world: int, hosts: float | None) -> dict[str, float | None]:
    return {"agent_fds": fds, WORLD: world, HOSTS_STORE: hosts}


def test_a_change_of_role_is_not_growth() -> None:
    # both roles in both quarters, in different proportions (as pids wrap)
    first = [_sample(37, 2, 1.0), _sample(26, 2, 0.0), _sample(26, 2, 0.0), _sample(26, 2, 0.0)]
    last = [_sample(37, 2, 1.0), _sample(37, 2, 1.0), _sample(37, 2, 1.0), _sample(26, 2, 0.0)]
    base, ours = _phase_medians("agent_fds", first, last)
    assert ours - base == 0  # by world alone: medians 26 and 37, an 11-descriptor "leak"


def test_growth_within_a_role_is_still_found() -> None:
    first = [_sample(26, 2, 0.0), _sample(37, 2, 1.0), _sample(26, 2, 0.0)]
    last = [_sample(31, 2, 0.0), _sample(37, 2, 1.0), _sample(31, 2, 0.0)]
    base, ours = _phase_medians("agent_fds", first, last)
    assert (base, ours) == (26, 31)
