"""One process's line of ``/proc/<pid>/stat``: its parent, start time and state.

Used to tell a process from a later one with the same pid (start time), to walk a
process tree (parent), and to see a stopped process (state ``T``/``t``).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["ProcStat", "read"]


class ProcStat(NamedTuple):
    """The fields of ``/proc/<pid>/stat`` we use."""

    ppid: int
    start_time: int  # clock ticks since boot: with the pid, unique for the uptime
    state: str  # R, S, D, T (stopped), t (tracing stop), Z, ...

    @property
    def stopped(self) -> bool:
        """Stopped by a signal (SIGSTOP, SIGTSTP) or a tracer: it runs no code."""
        return self.state in ("T", "t")


def read(pid: int) -> ProcStat | None:
    """``pid``'s stat fields, or ``None`` if it is gone (or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return ProcStat(int(fields[1]), int(fields[19]), fields[0].decode("ascii", "replace"))
    except (IndexError, ValueError):
        return None
