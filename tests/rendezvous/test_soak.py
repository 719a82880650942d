"""The churn soak, small: one linear history under joins, leaves and SIGKILLs (#9.2).

The full-size soak (8-16 agents, >= 1,000 transitions) is ``bench/rendezvous.py --soak``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.rendezvous.soak import run_soak


@pytest.mark.slow
def test_churn_soak_keeps_one_linear_history(tmp_path: Path) -> None:
    work = tmp_path / "soak"
    work.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    result = run_soak(work, agents=6, seconds=20.0, kill_every_s=2.0)
    assert result["linear"], result["problems"]
    assert result["kills"] >= 5
    assert result["transitions"] >= 100, result
    assert result["rounds"] >= 10, result
    # Nothing grows with churn: at most one file per agent alive at the end.
    dirs = result["dirs"]
    assert dirs["keys"] == 0 and dirs["hb"] <= 6 and dirs["intents"] <= 6, dirs
    assert dirs["segments"] <= 2 and dirs["merge_claims"] <= 3 and dirs["eras"] <= 3, dirs
