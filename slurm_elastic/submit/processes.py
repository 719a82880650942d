"""Process trees of local node agents, and stopping them without leaving orphans.

torch starts each worker in its own session, so killing an agent's process group does not
reach its workers, and a SIGKILLed agent orphans them (they keep running and keep the
collective alive). :func:`stop_tree` therefore follows the tree through ``/proc``
(parent links), remembering every descendant it has seen - a process identified by
``(pid, start time)`` so a recycled pid is never signalled - and kills what is left after
the grace period. Linux only (``/proc``), like Slurm.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence

from slurm_elastic import procstat

__all__ = ["ProcessKey", "alive", "descendants", "stop_tree"]

log = logging.getLogger(__name__)

#: (pid, start time in clock ticks since boot): unique for the machine's uptime.
ProcessKey = tuple[int, int]


def _table() -> dict[int, procstat.ProcStat]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = procstat.read(int(entry))
            if info is not None:
                out[int(entry)] = info
    return out


def descendants(roots: Iterable[int]) -> set[ProcessKey]:
    """Every live descendant of ``roots`` (not the roots themselves)."""
    table = _table()
    children: dict[int, list[int]] = {}
    for pid, info in table.items():
        children.setdefault(info.ppid, []).append(pid)
    found: set[ProcessKey] = set()
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), ()):
            if table[child].state != "Z":
                found.add((child, table[child].start_time))
                stack.append(child)
    return found


def alive(key: ProcessKey) -> bool:
    """Whether the process ``key`` still exists and is not a zombie."""
    info = procstat.read(key[0])
    return info is not None and info.start_time == key[1] and info.state != "Z"


def _signal(key: ProcessKey, sig: signal.Signals) -> None:
    if alive(key):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(key[0], sig)


def stop_tree(
    procs: Sequence[subprocess.Popen[bytes]],
    grace_s: float,
    first_signal: signal.Signals = signal.SIGTERM,
) -> set[ProcessKey]:
    """Stop ``procs`` and all their descendants; reap ``procs``.

    Sends ``first_signal`` to each process in ``procs`` (the agents forward it to their
    workers and wait for them), waits up to ``grace_s`` seconds, then SIGKILLs every
    process of the trees still alive, including workers orphaned meanwhile.

    Returns:
        The descendants that were still alive after SIGKILL and 5 more seconds (normally
        empty; a process in uninterruptible sleep can linger).
    """
    roots = [p.pid for p in procs]
    seen = descendants(roots)
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(first_signal)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        seen |= descendants(roots)
        if all(p.poll() is not None for p in procs) and not any(alive(k) for k in seen):
            break
        time.sleep(0.05)
    seen |= descendants(roots)
    leftovers = [k for k in seen if alive(k)]
    if leftovers or any(p.poll() is None for p in procs):
        log.warning(
            "local job: %d agents and %d of their processes still alive after %.0f s: SIGKILL",
            sum(p.poll() is None for p in procs),
            len(leftovers),
            grace_s,
        )
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    for key in leftovers:
        _signal(key, signal.SIGKILL)
    for proc in procs:
        proc.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(k) for k in seen):
        time.sleep(0.05)
    return {k for k in seen if alive(k)}
