"""Real torch elastic agents (LocalElasticAgent via elastic_launch) on our rendezvous.

Each agent is a separate Python process with two workers doing gloo all_reduce steps
(scripts/worker.py) and writing one record per step. A "node death" is SIGKILL of the
agent *and* its workers (torch starts workers in their own session, so killing only
the agent would leave them running, unlike a real node loss).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import read_jsonl, wait_for

SCRIPTS = Path(__file__).with_name("scripts")

pytestmark = pytest.mark.slow


class Agents:
    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "rdzv"
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, run_id: str, min_n: int, max_n: int) -> subprocess.Popen[bytes]:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        log = open(self.out / f"agent{len(self.procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "agent.py"), str(self.root), run_id,
             str(min_n), str(max_n), str(self.out)],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def records(self) -> list[dict[str, Any]]:
        return read_jsonl(self.out / "records.jsonl")

    def world_reached(self, world: int, *, exclude_masters: set[str] = frozenset()) -> list:  # type: ignore[assignment]
        """Records of a full world of ``world`` ranks (all ok), else an empty list."""
        recs = [
            r for r in self.records() if r["world"] == world and r["master"] not in exclude_masters
        ]
        by_master: dict[str, set[int]] = {}
        for r in recs:
            assert r["ok"], r
            by_master.setdefault(r["master"], set()).add(r["rank"])
        for master, ranks in by_master.items():
            if ranks == set(range(world)):
                return [r for r in recs if r["master"] == master]
        return []

    def kill_node(self, agent_pid: int) -> None:
        pids = {r["pid"] for r in self.records() if r["agent_pid"] == agent_pid}
        for pid in [agent_pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def stop_and_wait(self, procs: list[subprocess.Popen[bytes]], timeout: float = 90) -> None:
        (self.out / "stop").touch()
        for p in procs:
            assert p.wait(timeout) == 0, self.logs()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.out.glob("agent*.log"))
        )

    def cleanup(self) -> None:
        for r in self.records():
            for pid in (r["pid"], r["agent_pid"]):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Agents]:
    a = Agents(tmp_path)
    yield a
    a.cleanup()


def test_three_agents_form_one_world_of_six_workers(agents: Agents) -> None:
    procs = [agents.start("run", 3, 3) for _ in range(3)]
    recs = wait_for(lambda: agents.world_reached(6), 120, "a world of 6 workers")
    assert {r["group_rank"] for r in recs} == {0, 1, 2}
    assert len({r["agent_pid"] for r in recs}) == 3
    agents.stop_and_wait(procs)


def test_survivors_restart_on_a_new_store_after_the_store_host_dies(agents: Agents) -> None:
    procs = [agents.start("run", 2, 3) for _ in range(3)]
    first = wait_for(lambda: agents.world_reached(6), 120, "a world of 6 workers")
    old_master = first[0]["master"]
    host_pid = next(r["agent_pid"] for r in first if r["group_rank"] == 0)
    agents.kill_node(host_pid)
    second = wait_for(
        lambda: agents.world_reached(4, exclude_masters={old_master}),
        120,
        "the 2 surviving agents to run 4 workers on a new store",
    )
    assert host_pid not in {r["agent_pid"] for r in second}
    assert {r["group_rank"] for r in second} == {0, 1}
    survivors = [p for p in procs if p.pid != host_pid]
    agents.stop_and_wait(survivors)


def test_a_late_agent_grows_the_world_without_deadlock(agents: Agents) -> None:
    procs = [agents.start("run", 2, 3) for _ in range(2)]
    first = wait_for(lambda: agents.world_reached(4), 120, "a world of 4 workers")
    procs.append(agents.start("run", 2, 3))
    second = wait_for(
        lambda: agents.world_reached(6, exclude_masters={first[0]["master"]}),
        120,
        "the late agent to join a world of 6 workers",
    )
    assert len({r["agent_pid"] for r in second}) == 3
    # A membership change is not a failure: no restart budget was spent on it.
    assert {r["restart"] for r in second} == {0}
    agents.stop_and_wait(procs)
