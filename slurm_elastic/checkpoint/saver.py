"""The async saver: stage a state into host memory, write it on one background thread.

At most one save is in flight. :meth:`AsyncSaver.submit` first waits for the previous one
(surfacing its error), then stages (the only part the training loop waits for), then hands
the staged copy to the writer thread. The thread is not a daemon: a process that exits
normally finishes its save.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from slurm_elastic.checkpoint.staging import HostStager
from slurm_elastic.errors import CheckpointError

__all__ = ["AsyncSaver", "CheckpointFlushTimeout"]


class CheckpointFlushTimeout(CheckpointError, TimeoutError):
    """:meth:`CheckpointManager.flush` gave up waiting; the save is still in flight."""


class AsyncSaver:
    """One background writer plus the host staging buffers it reuses between saves."""

    def __init__(self) -> None:
        self._stager = HostStager()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[Path] | None = None
        self._lock = threading.Lock()

    def submit(self, state: Any, write: Callable[[Any, float], Path]) -> float:
        """Stage ``state`` and run ``write(staged, stall_seconds)`` in the background.

        The caller must have flushed the previous save. Returns the stall in seconds.
        """
        start = time.perf_counter()
        staged = self._stager.stage(state)
        stall = time.perf_counter() - start
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
            self._pending = self._executor.submit(write, staged, stall)
        return stall

    def flush(self, timeout: float | None, what: str) -> None:
        """Wait for the in-flight save; re-raise its error once.

        Raises:
            CheckpointFlushTimeout: still writing after ``timeout`` s (it keeps going).
        """
        with self._lock:
            pending = self._pending
        if pending is None:
            return
        try:
            pending.result(timeout=timeout)
        except FutureTimeout as exc:
            raise CheckpointFlushTimeout(
                f"checkpoint save into {what} still in flight after {timeout} s; "
                "give the preemption grace window more time (shutdown_timeout_s)"
            ) from exc
        finally:
            with self._lock:
                if self._pending is pending and pending.done():
                    self._pending = None

    @property
    def in_flight(self) -> bool:
        """Whether a save is still being written."""
        with self._lock:
            return self._pending is not None and not self._pending.done()

    def close(self) -> None:
        """Stop the writer thread (after the caller flushed) and free the buffers."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._stager.release()
