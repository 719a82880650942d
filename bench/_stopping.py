"""How a benchmark stops: nothing it started outlives it.

A bench started by hand or by ``bench/all.py`` is often stopped with a signal (Ctrl-C,
``kill``, a scheduler's time limit). Python's default SIGTERM ends the process without
running its ``finally`` blocks, so whatever the bench had started went on: the rendezvous
bench's 64 simulation processes loaded the machine for 17 minutes after their bench was
killed (2026-12-07), and the goodput and start-up benches' Slurm jobs stay in the queue
until their time limit. Every bench that ``bench/all.py`` runs, and the fault matrix,
calls :func:`stop_on_sigterm` in its ``main``; where a bench forks helper processes, each
calls :func:`die_with_parent` and the bench ends with :func:`end_children`; a bench that
runs another program (``bench/all.py`` runs each bench) does so with :func:`run_child`,
which passes a stop on to it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

#: ``prctl`` option: the signal this process gets when the thread that forked it exits.
_PR_SET_PDEATHSIG = 1
#: This process's C library, loaded before any fork (a child need not load it).
_LIBC = ctypes.CDLL(None, use_errno=True)

#: The signal that asked the bench to stop (0: none).
_STOP_SIGNAL = 0


def die_with_parent(parent: int | None = None) -> None:
    """Have the kernel SIGKILL this process once the process that forked it exits.

    Without it, a bench's children outlived a bench stopped by a signal that no handler
    sees (SIGKILL). Call it first thing in a forked child, or as a ``preexec_fn`` (the
    request survives ``exec``). Linux, as the benches; best effort elsewhere.

    Args:
        parent: the pid that forked this process, where the caller knows it; a
            parent already gone by then ends this process at once.
    """
    expected = os.getppid() if parent is None else parent
    with contextlib.suppress(AttributeError):  # the libc was loaded before the fork
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != expected:  # it exited before the request took effect
        os._exit(1)


def stop_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit(143)``: the bench's ``finally`` blocks then stop its
    processes, cancel its jobs and delete its work directory, as they do on Ctrl-C.

    Python drops an exception raised by a handler that runs inside a callback (it ran
    inside ``logging``'s after-fork hook, while the rendezvous bench forked: that bench
    went on and exited 0), so the signal is also kept, and :func:`check_stop` raises it
    again where a bench waits and between cases.
    """

    def stop(signum: int, _frame: Any) -> None:
        global _STOP_SIGNAL
        _STOP_SIGNAL = signum
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def check_stop() -> None:
    """Raise ``SystemExit`` if a stop signal came (its first raise may have been lost)."""
    if _STOP_SIGNAL:
        raise SystemExit(128 + _STOP_SIGNAL)


def end_children(timeout: float = 10.0) -> None:
    """SIGKILL this process's remaining children and reap them, before the work directory
    goes: a child forked just as a stop came is in no list, and would write on into it.
    Linux's ``/proc/PID/task/TID/children``; nothing to do where it is missing."""
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            pids.update(int(c) for c in (task / "children").read_text().split())
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
            except ChildProcessError:
                break
            time.sleep(0.02)


def run_child(
    cmd: list[str], *, timeout: float | None = None, grace: float = 60.0, **kwargs: Any
) -> subprocess.CompletedProcess[Any]:
    """:func:`subprocess.run`, but a child that must end early (its ``timeout``, or this
    bench stopped by a signal or Ctrl-C) gets SIGTERM and ``grace`` seconds to run its own
    clean-up before SIGKILL: ``subprocess.run`` SIGKILLs it at once, and a bench killed
    that way leaves its jobs and processes behind. Raises what ``subprocess.run`` raises
    (``TimeoutExpired`` after the child has ended)."""
    if kwargs.pop("capture_output", False):
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with subprocess.Popen(cmd, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            stop_child(proc, grace)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stop_child(proc: subprocess.Popen[Any], grace: float = 60.0) -> None:
    """SIGTERM ``proc``, wait up to ``grace`` seconds (reading its pipes), then SIGKILL."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
    except ValueError:  # its pipes were closed already
        proc.wait()
