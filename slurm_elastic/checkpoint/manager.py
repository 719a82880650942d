"""CheckpointManager: atomic, verified, retained, optionally asynchronous checkpoints.

See :mod:`slurm_elastic.checkpoint.manifest` for the on-disk layout and why it is safe on
a parallel filesystem. This module holds the write path (stage → serialize with inline
CRC32 → fsync → manifest → rename), the read path (newest checkpoint that verifies), the
retention policy, and the single background writer used by async saves.

Testing seam: ``testing_hook`` (a constructor argument) is called with the name of each
point of the write path (``"after_mkdir"``, ``"mid_data"``, ``"before_manifest"``,
``"before_commit"``, ``"after_commit"``). Tests use it to SIGKILL a child deterministically
at each point; production code leaves it ``None``.
"""

from __future__ import annotations

import builtins
import errno
import logging
import os
import shutil
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slurm_elastic import events
from slurm_elastic.checkpoint.manifest import (
    FileRecord,
    Manifest,
    fsync_dir,
    parse_step_dir,
    read_manifest,
    step_dir_name,
    verify_checkpoint,
    write_manifest,
)
from slurm_elastic.checkpoint.staging import HostStager, state_nbytes
from slurm_elastic.envvars import CHECKPOINT_DIR_ENV
from slurm_elastic.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWriteError,
)

__all__ = [
    "CHECKPOINT_DIR_ENV",
    "CheckpointFlushTimeout",
    "CheckpointInfo",
    "CheckpointManager",
    "LoadedCheckpoint",
    "describe_os_error",
]

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"
TMP_PREFIX = ".tmp-step_"
REPLACED_PREFIX = ".replaced-step_"


class CheckpointFlushTimeout(CheckpointError, TimeoutError):
    """:meth:`CheckpointManager.flush` gave up waiting; the save is still in flight."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint directory as seen by :meth:`CheckpointManager.list_checkpoints`.

    ``manifest`` is ``None`` when it cannot be read (the checkpoint is damaged).
    """

    step: int
    path: Path
    manifest: Manifest | None


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :meth:`CheckpointManager.load_latest` returns: the state and where it came from."""

    step: int
    path: Path
    state: Any
    manifest: Manifest


def describe_os_error(exc: OSError, path: Path, action: str) -> str:
    """Return a message naming the path, the cause and the fix for a failed write."""
    code = exc.errno
    if code in (errno.ENOSPC, errno.EDQUOT):
        hint = (
            "no space left (or quota exceeded): free space, lower keep_last, or point "
            "the checkpoint directory at a larger filesystem"
        )
    elif code in (errno.EACCES, errno.EPERM):
        hint = "permission denied: make the directory writable by this user"
    elif code == errno.EROFS:
        hint = "the filesystem is mounted read-only: choose a writable checkpoint directory"
    else:
        hint = os.strerror(code) if code else str(exc)
    return f"cannot {action} {path}: {hint} ({exc}); previous checkpoints are intact"


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class _ChecksumWriter:
    """A write-only file object that CRCs what it writes; handed to ``torch.save``."""

    def __init__(self, path: Path, on_bytes: Callable[[int], None]) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.crc = 0
        self.size = 0
        self.error: OSError | None = None
        self._on_bytes = on_bytes

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        self.crc = zlib.crc32(view, self.crc)
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as exc:
            self.error = exc  # torch may wrap it; keep the original for the message
            raise
        self.size += n
        self._on_bytes(self.size)
        return n

    def flush(self) -> None:
        """Nothing is buffered in user space."""

    def sync_and_close(self) -> None:
        try:
            os.fsync(self.fd)
        finally:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


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
        weights_only: passed to ``torch.load``; the default ``True`` refuses arbitrary
            pickled objects (loading a checkpoint then cannot run code).
        testing_hook: test seam, see the module docstring.

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
        testing_hook: Callable[[str], None] | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last} must be >= 1 (or None to keep all)")
        if keep_every is not None and keep_every < 1:
            raise CheckpointError(f"keep_every={keep_every} must be >= 1 (or None)")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self._rank = rank
        self.weights_only = weights_only
        self._hook = testing_hook
        self._stager = HostStager()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[Path] | None = None
        self._lock = threading.Lock()
        self.last_saved: Path | None = None

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
        Non-blocking: wait for any save still in flight (at most one), copy the state to
        host memory, return ``None`` and write in the background; :meth:`flush` waits.

        Args:
            state: a tree of dicts/lists/tensors/plain values (e.g. a training bundle).
            step: the step number (``step_<N>``); saving an existing step replaces it.
            metadata: small JSON-able fields stored in the manifest.
            blocking: see above.

        Returns:
            The committed directory (blocking save on rank 0), else ``None``.

        Raises:
            CheckpointWriteError: the write failed (no space, permission, read-only, a
                state that cannot be serialized); the previous checkpoints are intact.
                For a non-blocking save the error of the *previous* save is raised here.
        """
        if step < 0:
            raise CheckpointError(f"step={step} must be >= 0")
        self.flush()  # at most one in flight; surfaces the previous save's error
        if self.rank != 0:
            return None
        meta = dict(metadata or {})
        if blocking:
            return self._write(state, step, meta, time.perf_counter(), 0.0)
        start = time.perf_counter()
        staged = self._stager.stage(state)
        stall = time.perf_counter() - start
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
            self._pending = self._executor.submit(self._write, staged, step, meta, start, stall)
        log.debug("checkpoint step %d staged in %.3f s; writing in the background", step, stall)
        return None

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
        with self._lock:
            pending = self._pending
        if pending is not None:
            try:
                pending.result(timeout=timeout)
            except FutureTimeout as exc:
                raise CheckpointFlushTimeout(
                    f"checkpoint save into {self.directory} still in flight after {timeout} s; "
                    "give the preemption grace window more time (shutdown_timeout_s)"
                ) from exc
            finally:
                with self._lock:
                    if self._pending is pending and pending.done():
                        self._pending = None
        return self.last_saved

    @property
    def in_flight(self) -> bool:
        """Whether an async save is still being written."""
        with self._lock:
            return self._pending is not None and not self._pending.done()

    def close(self) -> None:
        """Flush, stop the background writer and release the staging buffers."""
        try:
            self.flush()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self._stager.release()

    def _call_hook(self, point: str) -> None:
        if self._hook is not None:
            self._hook(point)

    def _write(
        self, state: Any, step: int, metadata: dict[str, Any], start: float, stall: float
    ) -> Path:
        tmp = self.directory / f"{TMP_PREFIX}{step}-{uuid.uuid4().hex[:12]}"
        half = max(1, state_nbytes(state) // 2)
        mid_called = False

        def on_bytes(total: int) -> None:
            nonlocal mid_called
            if not mid_called and total >= half:
                mid_called = True
                self._call_hook("mid_data")

        writer: _ChecksumWriter | None = None
        action = "create checkpoint directory"
        try:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                os.mkdir(tmp, 0o755)
                self._call_hook("after_mkdir")
                action = "write checkpoint data"
                writer = _ChecksumWriter(tmp / STATE_FILE, on_bytes)
                try:
                    torch.save(state, writer)  # type: ignore[arg-type]
                except OSError:
                    raise
                except Exception as exc:
                    if writer.error is not None:
                        raise writer.error from exc
                    raise CheckpointWriteError(
                        f"cannot serialize the state for checkpoint {tmp}: {exc}; "
                        "save only tensors, containers and plain values"
                    ) from exc
                writer.sync_and_close()
                world = _dist_rank_world()[1]
                manifest = Manifest(
                    step=step,
                    kind="replicated",
                    world_size=world,
                    files=(FileRecord(STATE_FILE, writer.size, writer.crc),),
                    metadata=metadata,
                )
                self._call_hook("before_manifest")
                action = "write checkpoint manifest"
                write_manifest(tmp, manifest)
                fsync_dir(tmp)
                self._call_hook("before_commit")
                action = "commit checkpoint"
                final = self._commit(tmp, step)
            finally:
                if writer is not None:
                    writer.close()
        except OSError as exc:
            self._discard(tmp)
            message = describe_os_error(exc, tmp, action)
            log.error("%s", message)
            events.emit("checkpoint.failed", step=step, path=str(tmp), error=str(exc))
            raise CheckpointWriteError(message) from exc
        except CheckpointWriteError as exc:
            self._discard(tmp)
            events.emit("checkpoint.failed", step=step, path=str(tmp), error=str(exc))
            raise
        self._call_hook("after_commit")
        seconds = time.perf_counter() - start
        self.last_saved = final
        log.info(
            "checkpoint step %d saved: %s (%d bytes, %.2f s, stall %.3f s)",
            step,
            final,
            manifest.total_bytes,
            seconds,
            stall or seconds,
        )
        events.emit(
            "checkpoint.saved",
            step=step,
            path=str(final),
            bytes=manifest.total_bytes,
            seconds=seconds,
            stall_seconds=stall or seconds,
        )
        self._apply_retention(step)
        return final

    def _commit(self, tmp: Path, step: int) -> Path:
        final = self.directory / step_dir_name(step)
        if final.exists():
            # Saving a step again (e.g. after resuming from an older checkpoint): move the
            # old one aside first, so a crash in between leaves one of them complete.
            aside = self.directory / f"{REPLACED_PREFIX}{step}-{uuid.uuid4().hex[:12]}"
            log.warning("checkpoint %s exists; replacing it (old copy: %s)", final, aside)
            os.rename(final, aside)
            os.rename(tmp, final)
            fsync_dir(self.directory)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, final)
            fsync_dir(self.directory)
        return final

    @staticmethod
    def _discard(tmp: Path) -> None:
        try:
            shutil.rmtree(tmp)
        except FileNotFoundError:
            pass
        except OSError as exc:  # e.g. read-only: nothing was created anyway
            log.debug("could not remove %s: %s", tmp, exc)

    # ------------------------------------------------------------------ list / retention
    def list_checkpoints(self) -> builtins.list[CheckpointInfo]:
        """Committed checkpoints, oldest first (damaged ones have ``manifest=None``)."""
        infos: builtins.list[CheckpointInfo] = []
        try:
            entries = builtins.list(os.scandir(self.directory))
        except FileNotFoundError:
            return infos
        for entry in entries:
            step = parse_step_dir(entry.name)
            if step is None or not entry.is_dir():
                continue
            path = Path(entry.path)
            try:
                manifest: Manifest | None = read_manifest(path)
            except CheckpointCorruptError:
                manifest = None
            infos.append(CheckpointInfo(step, path, manifest))
        infos.sort(key=lambda i: i.step)
        return infos

    def incomplete(self) -> builtins.list[Path]:
        """Leftovers of interrupted saves (``.tmp-step_*``, ``.replaced-step_*``)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(
            self.directory / n for n in names if n.startswith((TMP_PREFIX, REPLACED_PREFIX))
        )

    def _apply_retention(self, just_saved: int) -> None:
        """Delete old checkpoints; never one at or after ``just_saved`` (verified by
        construction, so the newest verified checkpoint is never touched)."""
        for leftover in self.incomplete():
            log.warning("removing %s, left by an interrupted checkpoint save", leftover)
            shutil.rmtree(leftover, ignore_errors=True)
        if self.keep_last is None:
            return
        infos = self.list_checkpoints()
        keep = {i.step for i in infos[-self.keep_last :]}
        keep.update(i.step for i in infos if i.step >= just_saved)
        if self.keep_every is not None:
            keep.update(i.step for i in infos if i.step % self.keep_every == 0)
        for info in infos:
            if info.step in keep:
                continue
            log.info("retention: removing old checkpoint %s", info.path)
            try:
                shutil.rmtree(info.path)
            except OSError as exc:
                log.warning("retention could not remove %s: %s", info.path, exc)
            events.emit("checkpoint.removed", step=info.step, path=str(info.path))

    # ------------------------------------------------------------------ load
    def _skip(self, info: CheckpointInfo, exc: Exception) -> None:
        log.warning("skipping damaged checkpoint %s: %s", info.path, exc)
        events.emit("checkpoint.skipped", step=info.step, path=str(info.path), error=str(exc))

    def latest_verified(self, *, deep: bool = True) -> CheckpointInfo | None:
        """The newest committed checkpoint that verifies; damaged ones are skipped with a
        WARNING naming them (and never deleted)."""
        for leftover in self.incomplete():
            log.warning("ignoring %s: an interrupted checkpoint save (never committed)", leftover)
        for info in reversed(self.list_checkpoints()):
            try:
                manifest = verify_checkpoint(info.path, deep=deep)
            except CheckpointCorruptError as exc:
                self._skip(info, exc)
                continue
            return CheckpointInfo(info.step, info.path, manifest)
        return None

    def load_latest(
        self, map_location: Any = "cpu", *, mmap: bool = False
    ) -> LoadedCheckpoint | None:
        """Load the newest checkpoint that is complete and verifies.

        Damaged checkpoints are skipped with a WARNING naming them (never deleted, never
        returned). Under an initialized process group rank 0 chooses and broadcasts the
        step, so all ranks load the same one (every rank must then call this).

        Args:
            map_location: as for ``torch.load``.
            mmap: map the file instead of reading it (less memory; but the mapping keeps the
                file busy: on NFS retention then cannot remove its directory).

        Returns:
            The checkpoint, or ``None`` if there is none (first run).

        Raises:
            CheckpointCorruptError: the chosen checkpoint fails on a non-zero rank.
            CheckpointError: a checkpoint verifies but cannot be unpickled with
                ``weights_only`` (never silently skipped: that would restart from scratch).
        """
        dist = torch.distributed
        distributed = dist.is_available() and dist.is_initialized()
        loaded: LoadedCheckpoint | None = None
        if not distributed or dist.get_rank() == 0:
            for leftover in self.incomplete():
                log.warning(
                    "ignoring %s: an interrupted checkpoint save (never committed)", leftover
                )
            for info in reversed(self.list_checkpoints()):
                try:
                    loaded = self.load(info.step, map_location, mmap=mmap)
                    break
                except CheckpointCorruptError as exc:
                    self._skip(info, exc)
        if distributed and dist.get_world_size() > 1:
            box: builtins.list[Any] = [loaded.step if loaded else None]
            dist.broadcast_object_list(box, src=0)
            if dist.get_rank() != 0:
                return None if box[0] is None else self.load(box[0], map_location, mmap=mmap)
        return loaded

    def load(self, step: int, map_location: Any = "cpu", *, mmap: bool = False) -> LoadedCheckpoint:
        """Load checkpoint ``step``, verifying every CRC32 while it is read.

        The CRC pass runs in a second thread next to ``torch.load``, so the data is read
        from disk once (the other reader hits the page cache); a state whose file fails
        verification is discarded, never returned.

        Raises:
            CheckpointCorruptError: missing, incomplete or damaged.
            CheckpointError: not a replicated checkpoint, or not weights-only loadable.
        """
        path = self.directory / step_dir_name(step)
        if not path.is_dir():
            raise CheckpointCorruptError(f"checkpoint {path} does not exist")
        manifest = verify_checkpoint(path, deep=False)  # sizes: cheap, catches truncation
        if manifest.kind != "replicated":
            raise CheckpointError(
                f"checkpoint {path} is {manifest.kind!r}; load it with "
                "slurm_elastic.checkpoint.sharded.load_sharded"
            )
        start = time.perf_counter()
        with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-verify") as pool:
            verified = pool.submit(verify_checkpoint, path, deep=True)
            load_error: Exception | None = None
            state: Any = None
            try:
                state = torch.load(
                    path / STATE_FILE,
                    map_location=map_location,
                    weights_only=self.weights_only,
                    mmap=mmap,
                )
            except Exception as exc:
                load_error = exc
            verified.result()  # raises CheckpointCorruptError first: damage wins
        if load_error is not None:
            if self.weights_only and "weights_only" in str(load_error):
                raise CheckpointError(
                    f"checkpoint {path} holds objects outside torch's weights-only "
                    "allowlist; pass weights_only=False to CheckpointManager if you trust "
                    f"this directory ({load_error})"
                ) from load_error
            raise CheckpointCorruptError(
                f"checkpoint {path} verified but torch.load failed: {load_error}"
            ) from load_error
        seconds = time.perf_counter() - start
        log.info("checkpoint step %d loaded from %s", step, path)
        events.emit("checkpoint.loaded", step=step, path=str(path), seconds=seconds)
        return LoadedCheckpoint(step, path, state, manifest)
