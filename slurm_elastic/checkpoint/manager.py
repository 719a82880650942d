"""CheckpointManager: the replicated (DDP) front end of the checkpoint package.

It composes three parts: the torch-free :class:`~slurm_elastic.checkpoint.store.CheckpointStore`
(temporary names, commit, listing, retention, verification: the only code touching the
directory), the :mod:`~slurm_elastic.checkpoint.serializer` (our pickle-free container,
``torch.save`` as the fallback; CRC32 computed while writing) and the :class:`~slurm_elastic.checkpoint.saver.AsyncSaver` (host staging plus one
background writer). Crash points for tests: :mod:`slurm_elastic.checkpoint._faults`.

Loading tells damage from the environment: only our format's evidence (size, CRC32, a
manifest or header that does not parse) skips a checkpoint as damaged; a device that does
not exist on this node, an I/O or memory error raise
:class:`~slurm_elastic.checkpoint.trust.CheckpointReadError` and leave every checkpoint in
place (a run never restarts from scratch, nor its first save replaces a good step, because
of a node's problem). Checkpoints are bound to their run (``run_id``, by default
``$SLURM_ELASTIC_RUN_ID``): another run's directory is never resumed from or pruned.
"""

from __future__ import annotations

import builtins
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slurm_elastic import events
from slurm_elastic.checkpoint import _faults, exchange
from slurm_elastic.checkpoint.manifest import Manifest
from slurm_elastic.checkpoint.saver import AsyncSaver, CheckpointFlushTimeout
from slurm_elastic.checkpoint.serializer import (
    STATE_FILE,
    check_device,
    check_storable,
    read_state,
    write_state,
)
from slurm_elastic.checkpoint.store import (
    REPLACED_PREFIX,
    TMP_PREFIX,
    CheckpointInfo,
    CheckpointStore,
    checked_metadata,
    checked_step,
)
from slurm_elastic.checkpoint.transaction import SaveTransaction, describe_os_error, newest
from slurm_elastic.checkpoint.trust import (
    CheckpointReadError,
    ForeignRunError,
    UntrustedCheckpointError,
)
from slurm_elastic.envvars import CHECKPOINT_DIR_ENV, RUN_ID_ENV
from slurm_elastic.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWriteError,
)

__all__ = [
    "CHECKPOINT_DIR_ENV",
    "REPLACED_PREFIX",
    "STATE_FILE",
    "TMP_PREFIX",
    "CheckpointFlushTimeout",
    "CheckpointInfo",
    "CheckpointManager",
    "LoadedCheckpoint",
    "describe_os_error",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :meth:`CheckpointManager.load_latest` returns: the state and where it came from."""

    step: int
    path: Path
    state: Any
    manifest: Manifest


# A failure on rank 0 reaches the other ranks as (class name, message), never as a pickled
# exception: only these classes are re-created.
_FAILURES: dict[str, type[CheckpointError]] = {
    cls.__name__: cls
    for cls in (
        CheckpointError,
        CheckpointCorruptError,
        UntrustedCheckpointError,
        ForeignRunError,
        CheckpointReadError,
    )
}


def failure_message(exc: CheckpointError | None) -> list[str] | None:
    """``[class name, message]`` of a checkpoint error, to send to other ranks."""
    if exc is None:
        return None
    name = type(exc).__name__ if type(exc).__name__ in _FAILURES else "CheckpointError"
    return [name, str(exc)]


def failure_of(message: Any) -> CheckpointError | None:
    """The error :func:`failure_message` described (unknown names: ``CheckpointError``)."""
    if message is None:
        return None
    name, text = message
    return _FAILURES.get(str(name), CheckpointError)(str(text))


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class CheckpointManager:
    """Saves and loads training checkpoints under one directory on the shared filesystem.

    Replicated state (DDP: every rank holds the same model) is written by rank 0 only and
    read by every rank; :meth:`save` on other ranks returns ``None`` at once. For sharded
    state use :mod:`slurm_elastic.checkpoint.sharded`.

    Args:
        directory: where ``step_<N>/`` directories live (created on first save).
        keep_last: keep this many newest checkpoints (``None``: keep all).
        keep_every: additionally keep every checkpoint whose step is a multiple of this.
        rank: this process's rank (default: torch.distributed, else ``$RANK``, else 0).
        weights_only: passed to ``torch.load`` for the ``state.pt`` files of earlier
            versions (nothing else is ever unpickled); the default ``True`` refuses
            arbitrary pickled objects, so loading one cannot run code. ``False`` loads an
            old ``state.pt`` that holds other Python objects, if you trust its writer.
            Saving is the same either way: the pickle-free container, which refuses a
            state it cannot hold (a custom object) at save, naming it and the fix.
        run_id: the run these checkpoints belong to: recorded in every manifest; loading,
            saving or pruning in a directory holding another run's checkpoints raises
            :class:`~slurm_elastic.checkpoint.trust.ForeignRunError`. ``None`` (default):
            ``$SLURM_ELASTIC_RUN_ID`` (the agent sets it for its workers), else no run;
            ``""``: no run (nothing recorded; every checkpoint accepted).

    Raises:
        CheckpointError: ``keep_last``/``keep_every`` < 1.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        rank: int | None = None,
        weights_only: bool = True,
        run_id: str | None = None,
    ) -> None:
        if run_id is None:
            run_id = os.environ.get(RUN_ID_ENV) or None
        self.store = CheckpointStore(
            directory, keep_last=keep_last, keep_every=keep_every, run_id=run_id or None
        )
        self._rank = rank
        self.weights_only = weights_only
        self._saver = AsyncSaver()
        self.last_saved: Path | None = None
        #: seconds the training loop was blocked by the last committed save (blocking: the
        #: whole save; async: the save() call plus time spent in the staging guards)
        self.last_stall_seconds: float | None = None

    @property
    def directory(self) -> Path:
        """The checkpoint directory."""
        return self.store.directory

    @property
    def run_id(self) -> str | None:
        """The run these checkpoints belong to (``None``: no run)."""
        return self.store.run_id

    @property
    def keep_last(self) -> int | None:
        """Retention: how many newest checkpoints are kept."""
        return self.store.keep_last

    @property
    def keep_every(self) -> int | None:
        """Retention: steps divisible by this are kept too."""
        return self.store.keep_every

    @classmethod
    def from_env(
        cls, default: str | os.PathLike[str] | None = None, **kwargs: Any
    ) -> CheckpointManager:
        """Build a manager on ``$SLURM_ELASTIC_CHECKPOINT_DIR`` (set by the agent) or ``default``.

        Raises:
            CheckpointError: neither the variable nor ``default`` is set.
        """
        directory = os.environ.get(CHECKPOINT_DIR_ENV) or default
        if not directory:
            raise CheckpointError(
                f"no checkpoint directory: ${CHECKPOINT_DIR_ENV} is unset (run under the "
                "slurm_elastic agent) and no default was given"
            )
        return cls(directory, **kwargs)

    @property
    def rank(self) -> int:
        """This process's rank (only rank 0 writes replicated checkpoints)."""
        return self._rank if self._rank is not None else _dist_rank_world()[0]

    # ------------------------------------------------------------------ save
    def save(
        self,
        state: Any,
        step: int,
        *,
        metadata: Mapping[str, Any] | None = None,
        blocking: bool = True,
    ) -> Path | None:
        """Save ``state`` as checkpoint ``step``.

        Blocking: serialize the live state, commit, apply retention, return the path.
        Non-blocking: wait for any save still in flight (at most one), start copying the
        state to host memory in the background and return ``None``; the copy is guarded
        (the next ``optimizer.step()`` waits for it, a module's forward pass first copies
        its buffers; see :meth:`wait_staged`), then it is written in the background;
        :meth:`flush` waits for the write.

        Args:
            state: a tree of dicts/lists/tensors/plain values (e.g. a training bundle).
            step: the step number (``step_<N>``): an int >= 0 (numpy integers and 0-d
                integer tensors are accepted); saving an existing step replaces it.
            metadata: small JSON fields (str keys; str/int/float/bool/None/lists/dicts)
                stored in the manifest.
            blocking: see above.

        Returns:
            The committed directory (blocking save on rank 0), else ``None``.

        Raises:
            CheckpointError: ``step`` is not an integer >= 0 or ``metadata`` is not JSON
                (refused before anything is written).
            CheckpointWriteError: the write failed (no space, permission, read-only, a
                state that cannot be serialized); the previous checkpoints are intact.
                For a non-blocking save the error of the *previous* save is raised here.
        """
        step = checked_step(step)  # refuse before anything is written
        meta = checked_metadata(metadata)
        self.flush()  # at most one in flight; surfaces the previous save's error
        if self.rank != 0:
            return None
        if blocking:
            return self._write(state, step, meta, time.perf_counter(), None)
        start = time.perf_counter()
        check_storable(state)  # at the call, not at the next save: the write would refuse it
        stall = self._saver.submit(
            state, lambda staged, ready: self._write(staged, step, meta, start, ready)
        )
        log.debug("checkpoint step %d: staging started in %.4f s", step, stall)
        return None

    def wait_staged(self) -> None:
        """Wait until the in-flight async save has copied the state (not for the write).

        An async save copies tensors in the background after :meth:`save` returns; the
        next ``optimizer.step()`` and each module's forward pass wait for (or make) the
        copies they would otherwise change. Call this before changing state tensors in
        place any other way (e.g. ``param.copy_(...)``, a hand-written update); otherwise
        that save fails with :class:`~slurm_elastic.checkpoint.staging.StagingConflict`
        rather than commit a mixed copy.
        """
        self._saver.wait_staged()

    def flush(self, timeout: float | None = None) -> Path | None:
        """Wait until no save is in flight (what the preemption path calls).

        Args:
            timeout: seconds to wait at most (``None``: forever).

        Returns:
            The last committed checkpoint of this manager, if any.

        Raises:
            CheckpointFlushTimeout: still writing after ``timeout`` s (it keeps going).
            CheckpointWriteError: the background save failed (raised once).
        """
        self._saver.flush(timeout, str(self.directory))
        return self.last_saved

    @property
    def in_flight(self) -> bool:
        """Whether an async save is still being written."""
        return self._saver.in_flight

    def close(self) -> None:
        """Flush, stop the background writer and release the staging buffers."""
        try:
            self.flush()
        finally:
            self._saver.close()

    def _write(
        self,
        state: Any,
        step: int,
        metadata: dict[str, Any],
        start: float,
        ready: Callable[[], Callable[[], float]] | None,
    ) -> Path:
        stall_of: Callable[[], float] | None = None
        if ready is not None:
            try:
                stall_of = ready()  # the staged copies have landed, unchanged
            except CheckpointWriteError as exc:
                raise SaveTransaction(self.store, step, "replicated").abort(exc) from None
        with SaveTransaction.begin(self.store, step, "replicated", started=start) as txn:
            _faults.point("after_mkdir")
            record = write_state(state, txn.tmp)
            final, _ = txn.commit((record,), _dist_rank_world()[1], metadata, stall_of=stall_of)
        self.last_saved = final
        self.last_stall_seconds = txn.stall
        return final

    # ------------------------------------------------------------------ list
    def list_checkpoints(self) -> builtins.list[CheckpointInfo]:
        """Committed checkpoints, oldest first (damaged ones have ``manifest=None``)."""
        return self.store.list_checkpoints()

    def incomplete(self) -> builtins.list[Path]:
        """Leftovers of interrupted saves (never loaded)."""
        return self.store.incomplete()

    def latest_verified(self, *, deep: bool = True) -> CheckpointInfo | None:
        """The newest committed checkpoint that verifies; damaged ones are skipped with a
        WARNING naming them (and never deleted)."""
        return self.store.latest_verified(deep=deep)

    # ------------------------------------------------------------------ load
    def load_latest(
        self, map_location: Any = "cpu", *, mmap: bool | None = None
    ) -> LoadedCheckpoint | None:
        """Load the newest checkpoint that is complete and verifies.

        Damaged checkpoints (our format's evidence: size, CRC32, parse) are skipped with a
        WARNING naming them (never deleted, never returned). Anything else raises and
        leaves every checkpoint in place: a device that does not exist here, an I/O or
        memory error, an untrusted path, another run's directory. Under an initialized
        process group rank 0 chooses and broadcasts the step (or its error, raised on every
        rank), so all ranks load the same one (every rank must then call this).

        Args:
            map_location: as for ``torch.load``.
            mmap: map the file instead of reading it into fresh memory (less memory, faster;
                the tensors are copy-on-write views, the file is never changed). ``None``
                (the default) maps a ``state.bin`` unless the checkpoint directory is on NFS,
                where a live mapping keeps the file busy and retention could not remove its
                directory; ``True``/``False`` force it.

        Returns:
            The checkpoint, or ``None`` if there is none (first run).

        Raises:
            CheckpointCorruptError: the chosen checkpoint fails on a non-zero rank.
            CheckpointReadError: ``map_location`` names a device this node lacks, or an
                I/O or memory error (nothing is skipped or changed for it).
            ForeignRunError: the directory holds another run's checkpoints.
            UntrustedCheckpointError: a checkpoint path is not ours or writable by others.
            CheckpointError: a checkpoint verifies but cannot be unpickled with
                ``weights_only`` (never silently skipped: that would restart from scratch).
        """
        dist = torch.distributed
        distributed = dist.is_available() and dist.is_initialized()
        loaded: LoadedCheckpoint | None = None
        failure: CheckpointError | None = None
        if not distributed or dist.get_rank() == 0:
            try:
                loaded = self._load_newest(map_location, mmap)
            except CheckpointError as exc:
                if not distributed or dist.get_world_size() == 1:
                    raise
                failure = exc
        if distributed and dist.get_world_size() > 1:
            # the step and any failure as plain values (never a pickled object from a peer)
            step, message = exchange.broadcast(
                [loaded.step if loaded else None, failure_message(failure)], 0
            )
            failure = failure if dist.get_rank() == 0 else failure_of(message)
            if failure is not None:
                raise failure
            if dist.get_rank() != 0:
                if step is not None and type(step) is not int:
                    raise CheckpointError(f"rank 0 chose checkpoint {step!r:.40}, not a step")
                return None if step is None else self.load(step, map_location, mmap=mmap)
        return loaded

    def _load_newest(self, map_location: Any, mmap: bool | None) -> LoadedCheckpoint | None:
        check_device(map_location)  # a device missing here is the node's problem
        return newest(self.store, lambda info: self.load(info.step, map_location, mmap=mmap))

    def load(
        self, step: int, map_location: Any = "cpu", *, mmap: bool | None = None
    ) -> LoadedCheckpoint:
        """Load checkpoint ``step``; every byte is verified before anything is parsed.

        The checkpoint directory, the manifest and the data file must be owned by this user
        and not writable by others. A ``state.bin`` file is read once into memory (or
        mapped: see :meth:`load_latest` for ``mmap``) with its CRC32 computed alongside;
        only a match is parsed.
        A ``state.pt`` file (``torch.save``) is CRCed first, then ``torch.load`` reads it.

        Everything is opened through held directory descriptors (no links), so what was
        checked is what is read.

        Raises:
            CheckpointCorruptError: missing, incomplete or damaged.
            UntrustedCheckpointError: not owned by this user, or writable by others.
            ForeignRunError: another run's checkpoint.
            CheckpointReadError: a device missing here, an I/O or memory error (it stays).
            CheckpointError: not a replicated checkpoint, or not weights-only loadable.
        """
        path = self.store.step_path(step)
        start = time.perf_counter()
        check_device(map_location)
        with self.store.open_checkpoint(step) as held:
            # owner, mode and size of everything; read_state checks every CRC32 first
            manifest = self.store.verify(step, deep=False, at=held)
            if manifest.kind != "replicated" or len(manifest.files) != 1:
                raise CheckpointError(
                    f"checkpoint {path} is {manifest.kind!r}; load it with "
                    "slurm_elastic.checkpoint.sharded.load_sharded"
                )
            state = read_state(
                path,
                manifest.files[0],
                map_location,
                weights_only=self.weights_only,
                mmap=mmap,
                at=held,
            )
        seconds = time.perf_counter() - start
        log.info("checkpoint step %d loaded from %s", step, path)
        events.emit(events.CheckpointLoaded(step=step, path=str(path), seconds=seconds))
        return LoadedCheckpoint(step, path, state, manifest)
