"""Node directories of killed agents are removed by the next agent (issue: silent
failures; 15 empty ``slurm-elastic-node-*`` directories were left in the system
temporary directory after one suite run). Real agent processes, a real SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from slurm_elastic.agent import node_dirs
from tests.agent.conftest import single_agent
from tests.helpers import wait_for


def agent(tmp_path: Path, temp: Path, run_id: str, script: Path) -> subprocess.Popen[bytes]:
    state = str(tmp_path / "state")
    argv, env = single_agent(run_id, script, "--state-dir", state, TMPDIR=str(temp))
    log = open(tmp_path / f"{run_id}.log", "ab")  # noqa: SIM115 - the child holds it
    return subprocess.Popen(
        argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def test_the_next_agent_removes_the_node_directory_of_a_killed_one(tmp_path: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir(mode=0o700)
    (tmp_path / "long.py").write_text("import time\ntime.sleep(600)\n")
    (tmp_path / "short.py").write_text("print('done')\n")
    first = agent(tmp_path, temp, "killed", tmp_path / "long.py")
    try:
        mine = wait_for(
            lambda: [
                p for p in temp.iterdir() if p.name.startswith(f"slurm-elastic-node-{first.pid}.")
            ],
            60,
            "the first agent's node directory",
        )
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # agent and worker: nobody cleans up
        first.wait()
    assert mine[0].is_dir()  # left behind
    second = agent(tmp_path, temp, "next", tmp_path / "short.py")
    assert second.wait(120) == 0, (tmp_path / "next.log").read_text()
    assert not mine[0].exists()
    assert [p.name for p in temp.iterdir() if p.name.startswith("slurm-elastic-node-")] == []
    assert (
        "removed 1 node directories of agents that are gone" in (tmp_path / "next.log").read_text()
    )


def test_sweep_removes_only_our_directories_of_agents_that_are_gone(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    me = os.getpid()
    start = node_dirs._start_time(me)
    assert start is not None
    live = tmp_path / f"slurm-elastic-node-{me}.{start}-live"
    dead = tmp_path / f"slurm-elastic-node-{gone.pid}.777-dead"
    reused = tmp_path / f"slurm-elastic-node-{me}.{start + 1}-reused"  # same pid, another process
    old_style = tmp_path / "slurm-elastic-node-abc123"  # an earlier version: unknown agent
    target = tmp_path / "target"
    for d in (live, dead, reused, old_style, target):
        d.mkdir(mode=0o700)
    (dead / "notice").write_text("x")
    (target / "keep").write_text("x")
    link = tmp_path / f"slurm-elastic-node-{gone.pid}.778-link"
    link.symlink_to(target)
    (dead / "escape").symlink_to(target)  # a link inside: removed, never followed
    removed = node_dirs.sweep(tmp_path)
    assert sorted(removed) == sorted([dead, reused])
    assert live.is_dir() and old_style.is_dir() and link.is_symlink()
    assert (target / "keep").read_text() == "x"


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_sweep_leaves_another_users_directory(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    theirs = tmp_path / f"slurm-elastic-node-{gone.pid}.1-theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    assert node_dirs.sweep(tmp_path) == []
    assert theirs.is_dir()
