"""The one save/load choreography of every checkpoint, whatever writes the bytes.

A save is a :class:`SaveTransaction`: :meth:`~SaveTransaction.begin` makes a private
temporary directory (dead writers' leftovers removed, another run's directory refused),
the front end's writer puts its files there (the replicated one writes one container file
on rank 0; the sharded one lets DCP write on every rank), then
:meth:`~SaveTransaction.commit` writes the manifest, makes everything durable, renames
the directory to ``step_<N>``, logs, emits ``CheckpointSaved`` and applies retention.
Any failure goes through :meth:`~SaveTransaction.abort`: the temporary is removed (or
named, if it cannot be), ``CheckpointFailed`` is emitted, and the error names the path,
the cause and the fix; previous checkpoints are never touched.

A load is :func:`newest`: interrupted re-saves recovered, leftovers warned about, another
run's directory refused, then the newest checkpoint the front end's reader accepts;
damaged ones (our format's evidence only) are skipped with a WARNING and kept.

Torch-free: the front ends (``manager``, ``sharded``) own the bytes and the collectives.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from slurm_elastic import events
from slurm_elastic.checkpoint.manifest import FileRecord, Manifest
from slurm_elastic.checkpoint.store import CheckpointInfo, CheckpointStore
from slurm_elastic.errors import CheckpointCorruptError, CheckpointWriteError

__all__ = ["SaveTransaction", "describe_os_error", "newest"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def describe_os_error(
    exc: OSError, path: Path, action: str, *, leftover: Path | None = None
) -> str:
    """Return a message naming the path, the cause and the fix for a failed write.

    ``leftover``: a temporary that could not be removed; the message names it.
    """
    code = exc.errno
    if code in (errno.ENOSPC, errno.EDQUOT):
        hint = (
            "no space left on the filesystem (or quota exceeded): free space there (for "
            "example remove old step_* checkpoints you no longer need) or point the "
            "checkpoint directory at a larger filesystem"
        )
        try:
            vfs = os.statvfs(path.parent)
            hint += f"; {vfs.f_bavail * vfs.f_frsize} bytes are free"
        except OSError:
            pass
    elif code in (errno.EACCES, errno.EPERM):
        hint = "permission denied: make the directory writable by this user"
    elif code == errno.EROFS:
        hint = "the filesystem is mounted read-only: choose a writable checkpoint directory"
    else:
        hint = os.strerror(code) if code else str(exc)
    message = f"cannot {action} {path}: {hint} ({exc}); previous checkpoints are intact"
    if leftover is not None:
        message += f"; the partial temporary {leftover} could not be removed: remove it by hand"
    return message


class SaveTransaction:
    """One checkpoint save, from its temporary directory to its commit (module docstring).

    Used as a context manager by a single writer: an ``OSError`` inside becomes a
    :class:`CheckpointWriteError` naming :attr:`action` (what was being done), and any
    exception removes the temporary. A save spread over ranks calls :meth:`begin` and
    :meth:`commit` on the rank that owns the directory and :meth:`abort` with the first
    rank's failure.
    """

    def __init__(self, store: CheckpointStore, step: int, kind: str) -> None:
        self.store = store
        self.step = step
        self.kind = kind
        self.tmp = store.directory / "(not created)"
        self.created = False
        #: what is being done, for the error message (the front end updates it)
        self.action = f"create {kind} checkpoint in"
        self.started = time.perf_counter()  # a front end may set the save call's time
        self.seconds = self.stall = 0.0

    @classmethod
    def begin(
        cls, store: CheckpointStore, step: int, kind: str, *, started: float | None = None
    ) -> SaveTransaction:
        """Create the save's private temporary directory (``started``: when the save was
        asked for, ``time.perf_counter()``; default now).

        Raises:
            CheckpointWriteError: it cannot be created (names the directory and the fix).
            UntrustedCheckpointError, ForeignRunError: the directory is not this run's own.
        """
        txn = cls(store, step, kind)
        if started is not None:
            txn.started = started
        try:
            txn.tmp = store.begin(step)
        except OSError as exc:
            raise txn.abort(describe_os_error(exc, store.directory, txn.action)) from exc
        txn.created = True
        txn.action = f"write {kind} checkpoint data"
        return txn

    def commit(
        self,
        files: tuple[FileRecord, ...],
        world_size: int,
        metadata: Mapping[str, Any],
        *,
        stall_of: Callable[[], float] | None = None,
    ) -> tuple[Path, Manifest]:
        """Manifest, durable, renamed to ``step_<N>``; logged, emitted, retention applied.

        ``stall_of``: the seconds training was blocked (an async save's); default: the
        whole save (a blocking one). Both are kept in :attr:`seconds` and :attr:`stall`.

        Raises:
            CheckpointWriteError: the manifest or the rename failed (the temporary goes).
        """
        self.action = f"commit {self.kind} checkpoint"
        manifest = Manifest(
            step=self.step,
            kind=self.kind,
            world_size=world_size,
            files=files,
            metadata=metadata,
            run=self.store.run_id,
        )
        try:
            final = self.store.commit(self.tmp, manifest)
        except OSError as exc:
            leftover = self.store.discard(self.tmp)
            message = describe_os_error(exc, self.tmp, self.action, leftover=leftover)
            raise self.abort(message, discard=False) from exc
        self.created = False
        self.seconds = time.perf_counter() - self.started
        self.stall = self.seconds if stall_of is None else stall_of()
        log.info(
            "%s checkpoint step %d saved: %s (%d bytes, %.2f s, stall %.3f s)",
            self.kind, self.step, final, manifest.total_bytes, self.seconds, self.stall,
        )  # fmt: skip
        events.emit(
            events.CheckpointSaved(
                step=self.step, path=str(final), bytes=manifest.total_bytes,
                seconds=self.seconds, stall_seconds=self.stall, format=self.kind,
            )
        )  # fmt: skip
        self.store.apply_retention(self.step)
        return final, manifest

    def abort(
        self, error: str | CheckpointWriteError, *, discard: bool = True
    ) -> CheckpointWriteError:
        """Remove the temporary, emit ``CheckpointFailed``; the error to raise (a message
        becomes a :class:`CheckpointWriteError`, an error is returned as it is)."""
        message = str(error)
        if discard and self.created:
            leftover = self.store.discard(self.tmp)
            if leftover is not None:
                message += (
                    f"; the partial temporary {leftover} could not be removed: remove it by hand"
                )
                error = message
        self.created = False
        log.error("%s", message)
        events.emit(events.CheckpointFailed(step=self.step, path=str(self.tmp), error=message))
        return CheckpointWriteError(message) if isinstance(error, str) else error

    def __enter__(self) -> SaveTransaction:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None or not self.created:
            return
        if isinstance(exc, OSError):
            leftover = self.store.discard(self.tmp)
            self.created = False
            message = describe_os_error(exc, self.tmp, self.action, leftover=leftover)
            raise self.abort(message, discard=False) from exc
        if isinstance(exc, CheckpointWriteError):
            self.abort(exc)
            return
        self.store.discard(self.tmp)  # KeyboardInterrupt, a refused state...: no leftovers
        self.created = False


def newest(
    store: CheckpointStore,
    read: Callable[[CheckpointInfo], T | None],
    *,
    step: int | None = None,
) -> T | None:
    """The newest checkpoint ``read`` accepts (or checkpoint ``step``), else ``None``.

    ``read`` returns ``None`` for a checkpoint of another kind (looking on) and raises
    :class:`CheckpointCorruptError` for a damaged one: skipped with a WARNING naming it
    and kept; with ``step`` given, raised. Anything else it raises stops the search and
    leaves every checkpoint in place.
    """
    store.recover()  # a re-save that died between its renames
    store.warn_incomplete()
    infos = store.list_checkpoints()
    store.check_directory_run(infos)
    for info in reversed([i for i in infos if step is None or i.step == step]):
        try:
            found = read(info)
        except CheckpointCorruptError as exc:  # our format's evidence only
            if step is not None:
                raise
            store.report_damaged(info, exc)
            continue
        if found is not None:
            return found
    return None
