"""The era's side directories stay bounded over churn (#9, reported defect).

``keys/`` gained one empty file per joining agent (every agent outside Slurm has a key
of its own, and every requeue of an array task a new one); ``hb/`` kept the counter
file of every SIGKILLed node. Over weeks of churn both grow without bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

from slurm_elastic.rendezvous.run_directory import Incarnation, RunDirectory
from tests.helpers import wait_for
from tests.rendezvous.harness import NodeProc, check_world, rdzv_all
from tests.rendezvous.test_run_directory import _close, _touch_state


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith(".tmp"))


def test_keys_stay_bounded_over_local_agent_churn(tmp_path: Path) -> None:
    run = RunDirectory(tmp_path, "run")
    eras = {run.select_era(Incarnation.from_environ({})).number for _ in range(40)}
    assert len(eras) == 1
    era = run.era(eras.pop())
    # A derived local key is unique to its process: no later agent can ever match it.
    assert _names(era.keys_dir) == []


def test_a_requeued_allocation_replaces_its_earlier_key(tmp_path: Path) -> None:
    run = RunDirectory(tmp_path, "run")
    for restart in range(30):  # one array task requeued 30 times, two others running
        for task in ("8", "9", "10"):
            run.select_era(Incarnation("array-7", f"{task}.{restart}"))
    era = run.era(1)
    assert _names(era.keys_dir) == ["10.29", "8.29", "9.29"]


def test_a_closed_era_still_refuses_its_own_allocation(tmp_path: Path) -> None:
    run = RunDirectory(tmp_path, "run")
    e1 = run.select_era(Incarnation("array-7", "8.0"))
    run.select_era(Incarnation("array-7", "8.1"))  # the task requeued, same era
    _touch_state(run, e1.number)
    _close(run, e1.number)
    with pytest.raises(RendezvousClosedError, match="closed by this job"):
        run.select_era(Incarnation("array-7", "8.1"))
    # The dead incarnation 8.0 cannot start again; another task opens a new era.
    assert run.select_era(Incarnation("array-7", "9.0")).number == e1.number + 1


def test_explicit_local_keys_are_still_recorded(tmp_path: Path) -> None:
    run = RunDirectory(tmp_path, "run")
    inc = Incarnation.from_environ({}, key="mine")
    era = run.select_era(inc)
    assert _names(era.keys_dir) == ["mine"]


def test_heartbeat_files_of_sigkilled_nodes_are_removed(tmp_path: Path) -> None:
    made: list[NodeProc] = []
    try:
        for _ in range(4):
            node = NodeProc(tmp_path, "run", 2, 4)
            made.append(node)
            node.call("create")
        check_world(rdzv_all(made), 4)
        hb = next((tmp_path / "run").glob("era.*")) / "hb"
        assert len(_names(hb)) == 4
        for victim in made[2:]:
            victim.kill()
        # Both are evicted, and their counters go with them (the survivors' stay).
        wait_for(lambda: len(_names(hb)) == 2, 20, "the dead nodes' heartbeat files removed")
        for node in made[:2]:
            node.call("wait_change", 15)
        check_world(rdzv_all(made[:2]), 2)
        assert len(_names(hb)) == 2
    finally:
        for node in made:
            node.close()
