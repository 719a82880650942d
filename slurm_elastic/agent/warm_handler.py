"""The seam where torch starts a worker process, given to :mod:`.warm_workers`.

torch's ``SubprocessContext._start`` builds one handler per local rank through the
module-level ``get_subprocess_handler`` of ``torch.distributed.elastic.multiprocessing.api``;
each ``SubprocessHandler`` opens the log files, builds the environment and the command,
and calls ``self._popen(args, env)``. :func:`warm_starts` replaces that factory for the
duration of one ``_start_workers`` call (the agent's main thread; nothing else starts
processes meanwhile) with one whose handlers' ``_popen`` asks the waiting interpreters
first. Everything else (log files, ``close()`` with ``killpg``, ``poll()``) stays torch's.
``tests/agent/test_warm_workers.py`` pins the seam: the factory's name and arguments, and
that ``_popen`` gets ``(args, env)`` after ``_stdout``, ``_stderr`` and ``local_rank_id``
are set.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from subprocess import Popen
from typing import Any

from torch.distributed.elastic.multiprocessing import api as _mp_api
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from slurm_elastic.agent.warm_workers import WarmWorkers

__all__ = ["warm_starts"]


@contextlib.contextmanager
def warm_starts(warm: WarmWorkers | None) -> Iterator[None]:
    """Within the block, torch starts workers through ``warm`` where it can."""
    if warm is None or not len(warm):
        yield
        return
    pool = warm  # (bound for the class below)

    class _WarmHandler(SubprocessHandler):
        def _popen(self, args: tuple, env: dict[str, str]) -> Popen:
            # No log file: the worker writes where the agent does (as torch's Popen would).
            out = self._stdout.fileno() if self._stdout else 1
            err = self._stderr.fileno() if self._stderr else 2
            proc = pool.take(self.local_rank_id, args, env, (out, err))
            return proc if proc is not None else super()._popen(args, env)

    def factory(*args: Any, **kwargs: Any) -> SubprocessHandler:
        return _WarmHandler(*args, **kwargs)

    original = _mp_api.get_subprocess_handler
    _mp_api.get_subprocess_handler = factory
    try:
        yield
    finally:
        _mp_api.get_subprocess_handler = original
