"""Small helpers shared by the test suite (add to it, don't rewrite it)."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from slurm_elastic import ledger
from slurm_elastic.submit import processes

T = TypeVar("T")

__all__ = [
    "Other",
    "process_tree",
    "read_jsonl",
    "run_ranks",
    "second_user",
    "survives_signal",
    "wait_for",
]


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.02) -> T:
    """Poll ``predicate`` until it returns a truthy value; return that value.

    Raises:
        AssertionError: the deadline passed; the message names ``what`` was awaited.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.1f} s waiting for {what}")
        time.sleep(interval)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file that writers may be appending to right now: only
    complete lines count, a malformed complete line raises (``slurm_elastic.ledger.read``,
    which reads any JSON-lines file that way)."""
    return ledger.read(path)


@dataclass
class Other:
    """A second local user (made by :func:`second_user`): the hostile neighbour."""

    name: str
    uid: int
    gid: int

    def become(self) -> None:
        """Switch this (forked) process to the user, umask 002."""
        os.setgroups([self.gid])
        os.setgid(self.gid)
        os.setuid(self.uid)
        os.umask(0o002)

    def start(self, action: Callable[[], None]) -> int:
        """Run ``action`` as this user in a forked child; return its pid (exit 0: done)."""
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            code = 1
            try:
                self.become()
                action()
                code = 0
            except BaseException as exc:
                print(f"as {self.name}: {type(exc).__name__}: {exc}", flush=True)
            os._exit(code)
        return pid

    def run(self, action: Callable[[], None]) -> None:
        """Run ``action`` as this user in a forked child; raise if it failed."""
        _, status = os.waitpid(self.start(action), 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the other user's action failed"


@contextlib.contextmanager
def second_user() -> Iterator[Other]:
    """A new local user in a new group of its own (needs root); removed afterwards."""
    import grp
    import pwd

    name = f"se{secrets.token_hex(4)}"
    subprocess.run(["groupadd", name], check=True)
    try:
        subprocess.run(
            ["useradd", "-M", "-N", "-g", name, "-s", "/usr/sbin/nologin", name], check=True
        )
        try:
            yield Other(name, pwd.getpwnam(name).pw_uid, grp.getgrnam(name).gr_gid)
        finally:
            subprocess.run(["userdel", name], check=False)
    finally:
        subprocess.run(["groupdel", name], check=False, stderr=subprocess.DEVNULL)


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants alive now (``slurm_elastic.submit.processes``)."""
    return [root, *sorted(pid for pid, _ in processes.descendants([root]))]


def survives_signal(pid: int, signum: int) -> bool | None:
    """Whether signal ``signum`` cannot kill ``pid`` now: the process catches or ignores
    it (``SigCgt``/``SigIgn`` of ``/proc/<pid>/status``: process-wide dispositions).

    Returns:
        ``None`` when the process is gone.
    """
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    bit = 1 << (signum - 1)
    masks = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("SigCgt", "SigIgn"):
            masks[key] = int(value.strip(), 16)
    return any(mask & bit for mask in masks.values())


def run_ranks(argvs: list[list[str]], out: Path, deadline_s: float) -> list[Any]:
    """Run one process per rank (``argvs[r]``, the repository on ``PYTHONPATH``, one
    thread each) until all exit or ``deadline_s`` passes, then read ``out/rank<r>.json``
    of each; a missing result fails with every rank's output."""
    import json
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for argv in argvs
    ]
    end = time.monotonic() + deadline_s
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, end - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for rank in range(len(argvs)):
        f = out / f"rank{rank}.json"
        assert f.exists(), f"rank {rank} wrote no result; output:\n" + "\n".join(logs)
        results.append(json.loads(f.read_text()))
    return results
