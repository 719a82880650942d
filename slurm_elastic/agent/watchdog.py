"""The agent's hang watchdog clock: progress ages measured on the node's monotonic clock.

Workers rewrite their progress file (:func:`slurm_elastic.notice.report_progress`) as they
make progress. The watchdog never compares the wall-clock time written in the file with
its own wall clock (a clock step of +100 s would then look like 100 s without progress
and restart healthy workers): it notes, on its own ``time.monotonic()``, when it last saw
the file's content change, and the age of the progress is the monotonic time since.

The file is read with :func:`slurm_elastic.channel.read_node_file`: a FIFO, a directory or
a link at its name, or a file too large to be a progress line, reads as no report (with a
warning), so it can neither block the agent's monitor loop nor pass for progress.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from slurm_elastic.channel import read_node_file

__all__ = ["ProgressWatch"]

log = logging.getLogger(__name__)

# The progress line is 42 bytes; a larger file is not one and is not read.
_MAX_BYTES = 4096


class ProgressWatch:
    """Age of the last progress report, on the reader's monotonic clock.

    Args:
        path: the workers' progress file.
        clock: the monotonic clock (injectable for tests).

    The watch arms at the first report of a set of workers (:meth:`reset` disarms it):
    start-up may legitimately take long.
    """

    def __init__(self, path: str | os.PathLike[str], clock: Callable[[], float] = time.monotonic):
        self._path = os.fspath(path)
        self._clock = clock
        self._last: bytes | None = None
        self._changed_at: float | None = None

    def reset(self) -> None:
        """Forget what was seen (new workers start: the watch re-arms at their first report)."""
        self._last = None
        self._changed_at = None

    def _read(self) -> bytes | None:
        found = read_node_file(self._path, _MAX_BYTES, log)
        return None if found is None else found.data

    def age_s(self) -> float:
        """Seconds since the progress content last changed; 0 before the first report."""
        now = self._clock()
        content = self._read()
        if content is not None and content != self._last:
            self._last = content
            self._changed_at = now
        if self._changed_at is None:
            return 0.0
        return now - self._changed_at
