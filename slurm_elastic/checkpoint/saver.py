"""The async saver: stage a state into host memory, write it on one background thread.

At most one save is in flight (the caller flushes the previous one first).
:meth:`AsyncSaver.submit` starts staging (:mod:`~slurm_elastic.checkpoint.staging`: the
tree walk is synchronous, the tensor copies run in the background behind guards) and hands
the staged copy to the writer thread, which waits for the copies, checks that no tensor
changed meanwhile, then writes. The thread is not a daemon: a process that exits normally
finishes its save.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from slurm_elastic.checkpoint.staging import HostStager, StagingRound, remove_idle_guards, retire
from slurm_elastic.errors import CheckpointFlushTimeout

__all__ = ["AsyncSaver", "CheckpointFlushTimeout"]


class AsyncSaver:
    """One background writer plus the host staging buffers it reuses between saves."""

    def __init__(self) -> None:
        self._stager = HostStager()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[Path] | None = None
        self._round: StagingRound | None = None
        self._lock = threading.Lock()

    def submit(
        self, state: Any, write: Callable[[Any, Callable[[], Callable[[], float]]], Path]
    ) -> float:
        """Start staging ``state``; run ``write(staged, ready)`` in the background.

        ``write`` must call ``ready()`` before it reads ``staged``: it waits for the copies,
        raises :class:`~slurm_elastic.checkpoint.staging.StagingConflict` if a tensor
        changed meanwhile, and returns a function giving the seconds the training loop
        was blocked (this call plus the time spent in guards; read it after the write,
        when every guard has finished counting). The caller must have flushed the previous
        save. Returns this call's duration in seconds.
        """
        start = time.perf_counter()
        staged, round_ = self._stager.begin(state)
        stall = time.perf_counter() - start

        def ready() -> Callable[[], float]:
            try:
                round_.wait(help_copy=False)  # the staging threads and the guards copy
            finally:
                retire(round_)
            round_.check()
            return lambda: stall + round_.guard_seconds

        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
            self._round = round_
            self._pending = self._executor.submit(write, staged, ready)
        return stall

    def wait_staged(self) -> None:
        """Block until the in-flight save's copies have landed (the explicit guard)."""
        with self._lock:
            round_ = self._round
        if round_ is not None:
            round_.wait()

    def flush(self, timeout: float | None, what: str) -> None:
        """Wait for the in-flight save; re-raise its error once.

        Raises:
            CheckpointFlushTimeout: still writing after ``timeout`` s (it keeps going).
        """
        with self._lock:
            pending = self._pending
        if pending is None:
            remove_idle_guards()
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
                    self._round = None
            if pending.done():
                remove_idle_guards()

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
