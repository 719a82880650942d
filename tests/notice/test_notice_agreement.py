"""`notice.preemption_agreed` and `notice.await_new_round` across real processes (gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from slurm_elastic.channel import NODE_DIR_ENV
from tests.helpers import wait_for

CHILD = r"""
import os, sys
import torch.distributed as dist
from slurm_elastic import notice
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=3)
print(notice.preemption_agreed())
dist.destroy_process_group()
"""


def test_a_notice_on_one_node_is_agreed_by_every_rank(tmp_path: Path) -> None:
    (tmp_path / "notice").write_text("preempt\n")
    procs = []
    for rank in range(3):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop(NODE_DIR_ENV, None)
        if rank == 1:  # only rank 1's node was told to stop
            env[NODE_DIR_ENV] = str(tmp_path)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", CHILD, str(rank), str(tmp_path / "store")],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert outputs == ["(True, False)", "(True, True)", "(True, False)"]


def test_without_notice_nobody_stops(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != NODE_DIR_ENV}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(r), str(tmp_path / "s")],
            env={**env, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(3)
    ]
    assert [p.communicate(timeout=120)[0].strip() for p in procs] == ["(False, False)"] * 3


AWAIT = r"""
import sys, time
from pathlib import Path

from tests.helpers import wait_for
from slurm_elastic import notice
Path(sys.argv[1]).write_text("ready")
start = time.monotonic()
got = notice.await_new_round(float(sys.argv[2]), poll_s=0.02)
print(got, round(time.monotonic() - start, 2))
"""


def test_await_new_round_returns_as_soon_as_this_node_gets_its_notice(tmp_path: Path) -> None:
    node = tmp_path / "node"
    node.mkdir()
    notice_file, ready = node / "notice", tmp_path / "ready"
    env = {**os.environ, NODE_DIR_ENV: str(node)}
    proc = subprocess.Popen(
        [sys.executable, "-c", AWAIT, str(ready), "60"], env=env, stdout=subprocess.PIPE, text=True
    )
    wait_for(ready.exists, 60, "the worker to start waiting")
    notice_file.write_text("preempt\n")
    got, waited = proc.communicate(timeout=60)[0].split()
    assert got == "True" and float(waited) < 30


def test_await_new_round_gives_up_after_its_timeout(tmp_path: Path) -> None:
    env = {**os.environ, NODE_DIR_ENV: str(tmp_path / "never")}
    out = subprocess.run(
        [sys.executable, "-c", AWAIT, str(tmp_path / "ready"), "0.3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    assert out[0] == "False" and float(out[1]) >= 0.3


ORPHAN = r"""
import os, sys, time
from pathlib import Path

from slurm_elastic import notice
ready, out = Path(sys.argv[1]), Path(sys.argv[2])
parent = os.getppid()
ready.write_text("ready")
start = time.monotonic()
got = notice.await_new_round(60, poll_s=0.02, parent_pid=parent)
out.write_text(f"{got} {time.monotonic() - start:.2f}")
"""
MIDDLE = r"""
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
time.sleep(600)
"""


def test_await_new_round_stops_waiting_when_its_agent_is_gone(tmp_path: Path) -> None:
    # A SIGKILLed agent leaves its worker behind; no agent will stop it, so waiting out
    # the timeout would only let it start a step long after its peers moved on.
    ready, out = tmp_path / "ready", tmp_path / "out"
    env = {**os.environ, NODE_DIR_ENV: str(tmp_path / "never")}
    agent = subprocess.Popen([sys.executable, "-c", MIDDLE, ORPHAN, str(ready), str(out)], env=env)
    try:
        wait_for(ready.exists, 60, "the worker to start waiting")
        agent.kill()
        agent.wait(30)
        text = wait_for(lambda: out.exists() and out.read_text(), 30, "the worker to stop waiting")
    finally:
        agent.kill()
    got, waited = text.split()
    assert got == "True" and float(waited) < 30, text
