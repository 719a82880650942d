"""A stopped rendezvous benchmark leaves no process behind.

``bench/rendezvous.py`` forks light processes that simulate up to thousands of agents.
Stopped by a signal, the bench used to leave them running: 64 processes of 64 agents
each, waiting for a start that never came, still loaded the machine 17 minutes later
(2026-12-07). Now SIGTERM stops the bench as Ctrl-C does (its processes stopped, its
work directory deleted, exit status 143), and the kernel kills every child whose bench
is gone, even after a SIGKILL that no handler sees: the simulation's processes and, where
etcd is installed (the README's test command installs it), the bench's etcd server, which
once stayed behind. The real bench runs here, from the checkout, as its documentation
runs it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A simulation of 1,024 agents (16 processes) and nothing before it.
ARGS = ["--only-formation", "--sizes", "2", "--backends", "slurm", "--sim-sizes", "1024",
        "--store-sizes", ""]  # fmt: skip


def _children(pid: int) -> set[int]:
    """The processes ``pid`` forked that are still its children (all its threads)."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out.update(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError):
            continue
    return out


#: A process as first seen: its pid and its start time (a pid reused later is another).
Proc = tuple[int, str]


def _identity(pid: int) -> Proc | None:
    """``pid`` with its start time while it runs (None: gone, or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else (pid, fields[19])


def _alive(proc: Proc) -> bool:
    return _identity(proc[0]) == proc


def _wait(what: str, condition, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"within {timeout:.0f} s: {what}")
        time.sleep(0.05)


class _Bench:
    """The real bench in its own process; its output lines collected as they come."""

    def __init__(self, tmp: Path) -> None:
        env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "bench/rendezvous.py", *ARGS],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.seen: set[Proc] = set()  # every child seen (killed at the end if a test fails)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def work_dir(self) -> Path | None:
        for line in self.lines:
            if line.startswith("# work directory "):
                return Path(line.split()[3])
        return None

    def simulation_processes(self, at_least: int, timeout: float) -> set[Proc]:
        """Wait until the simulation's processes run; return them."""

        def running() -> bool:
            self.seen.update(p for p in map(_identity, _children(self.proc.pid)) if p)
            return len([p for p in self.seen if _alive(p)]) >= at_least

        try:
            _wait(f"{at_least} simulation processes of the bench", running, timeout)
        except AssertionError:
            raise AssertionError("\n".join(self.lines[-20:])) from None
        return {p for p in self.seen if _alive(p)}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def bench(tmp_path: Path):  # type: ignore[no-untyped-def]
    b = _Bench(tmp_path)
    try:
        yield b
    finally:
        b.stop()
        for p in b.seen:  # alive only if the test failed: never leave them running
            if _alive(p):
                os.kill(p[0], signal.SIGKILL)
        work = b.work_dir()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


@pytest.mark.skipif(sys.platform != "linux", reason="the bench reads /proc (Linux only)")
def test_sigterm_stops_the_simulation_and_deletes_the_work_directory(bench: _Bench) -> None:
    children = bench.simulation_processes(at_least=8, timeout=120)
    work = bench.work_dir()
    assert work is not None and work.is_dir()
    bench.proc.send_signal(signal.SIGTERM)
    assert bench.proc.wait(60) == 128 + signal.SIGTERM
    _wait(f"the simulation processes {sorted(children)} end", lambda: not any(
        _alive(p) for p in children), timeout=30)  # fmt: skip
    assert not work.exists(), sorted(str(p) for p in work.rglob("*"))[:5]


@pytest.mark.skipif(sys.platform != "linux", reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_the_simulation_dies_with_a_killed_bench(bench: _Bench) -> None:
    children = bench.simulation_processes(at_least=8, timeout=120)
    bench.proc.kill()  # no handler runs: only the kernel can end the children
    bench.proc.wait(30)
    _wait(f"the simulation processes {sorted(children)} end", lambda: not any(
        _alive(p) for p in children), timeout=30)  # fmt: skip
