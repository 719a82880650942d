"""Sharded (FSDP/DTensor) checkpoints through ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shards with DCP's ``FileSystemWriter`` (``sync_files=True``)
into the same ``.tmp-step_<N>-<uuid>/`` directory on the shared filesystem; rank 0 then
writes our manifest (CRC32 of every DCP file, including DCP's ``.metadata``) and commits
with the same directory rename as replicated checkpoints. DCP's own format is kept, so a
load reshards to whatever world size and placement the live ``state_dict`` has.

Both calls are collective: every rank must call them, with a process group initialized.

Loading reads what was verified: every rank opens the checkpoint directory and
``step_<N>`` through held descriptors (:class:`~slurm_elastic.checkpoint.trust.CheckpointDir`:
no links, ours, not writable by others, this run's), checks that it holds the manifest
rank 0 verified, and DCP is pointed at ``/proc/self/fd/<fd>`` of that held directory: a
neighbour renaming directories meanwhile cannot make DCP unpickle their ``.metadata``.
A failure on any rank is raised on every rank before DCP starts.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from slurm_elastic import events
from slurm_elastic.checkpoint import exchange
from slurm_elastic.checkpoint.manager import CheckpointManager, failure_message, failure_of
from slurm_elastic.checkpoint.manifest import FileRecord, Manifest, crc32, crc32_file
from slurm_elastic.checkpoint.store import CheckpointInfo, checked_metadata, checked_step
from slurm_elastic.checkpoint.transaction import SaveTransaction, describe_os_error, newest
from slurm_elastic.checkpoint.trust import CheckpointDir, read_error
from slurm_elastic.errors import CheckpointError, CheckpointWriteError

__all__ = ["load_sharded", "save_sharded"]

log = logging.getLogger(__name__)


def _broadcast(value: Any) -> Any:
    """Rank 0's plain value (``None``, numbers, strings, lists) on every rank, no pickle."""
    return exchange.broadcast(value, 0)


def _identity(manifest: Manifest) -> int:
    """A fingerprint of one committed checkpoint (its manifest's exact text)."""
    return crc32(manifest.to_json().encode())


def _require_pg() -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise CheckpointError(
            "sharded checkpoints need an initialized process group; call "
            "torch.distributed.init_process_group first (or use CheckpointManager.save)"
        )
    return dist.get_rank(), dist.get_world_size()


def _os_error_in(exc: BaseException) -> OSError | None:
    """The first ``OSError`` inside ``exc`` (DCP's per-rank failures, causes, contexts)."""
    stack, seen = [exc], set()
    while stack:
        err = stack.pop()
        if id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError):
            return err
        if isinstance(err, CheckpointException):
            for failure in err.failures.values():
                stack.append(failure[0] if isinstance(failure, tuple) else failure)
        stack += [e for e in (err.__cause__, err.__context__) if e is not None]
    return None


def _full_disk(tmp: Path, state_dict: dict[str, Any]) -> OSError | None:
    """An ENOSPC error if ``tmp``'s filesystem has less room than this rank's shard.

    torch's zip writer turns a failed write into ``RuntimeError("unexpected pos ...")``,
    losing the ``OSError``; the free space tells what happened.
    """
    try:
        vfs = os.statvfs(tmp.parent)
    except OSError:
        return None
    free = vfs.f_bavail * vfs.f_frsize
    local = sum(
        t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
        for t in state_dict.values()
        if isinstance(t, torch.Tensor)
    )
    if free < max(local, 1 << 20):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
    return None


def _summary(exc: BaseException) -> str:
    """One line per failed rank (DCP's CheckpointException carries whole tracebacks)."""
    if isinstance(exc, CheckpointException):
        parts = []
        for rank, failure in sorted(exc.failures.items()):
            err = failure[0] if isinstance(failure, tuple) else failure
            parts.append(f"rank {rank}: {type(err).__name__}: {err}")
        return "; ".join(parts)
    return f"{type(exc).__name__}: {exc}"


def save_sharded(
    manager: CheckpointManager,
    state_dict: dict[str, Any],
    step: int,
    *,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Save a (sharded) state dict as checkpoint ``step`` of ``manager``'s directory.

    Raises:
        CheckpointWriteError: any rank failed to write (all ranks raise); previous
            checkpoints are intact.
    """
    step = checked_step(step)
    meta = checked_metadata(metadata)
    rank, world = _require_pg()
    manager.flush()
    store = manager.store
    txn: SaveTransaction | None = None
    error: str | None = None
    if rank == 0:
        try:
            txn = SaveTransaction.begin(store, step, "sharded")
        except CheckpointError as exc:  # its CheckpointFailed is emitted
            error = str(exc)
    tmp_name = _broadcast(txn.tmp.name if txn is not None else None)
    if tmp_name is not None:
        error = _write(state_dict, store.directory / tmp_name)
    errors = exchange.all_gather(error)  # every rank's write before the commit
    first = next((str(e) for e in errors if e), None)
    if txn is not None and first is None:
        try:
            txn.commit(_records(txn.tmp), world, meta)
        except CheckpointWriteError as exc:  # the temporary is gone
            first = str(exc)
    elif txn is not None and first is not None:  # another rank's failure: the temporary goes
        first = str(txn.abort(first))
    first = _broadcast(first)  # rank 0's word: it knows every rank's failure
    if first is not None:
        raise CheckpointWriteError(str(first))
    dist.barrier()  # nobody loads before the commit
    return store.step_path(step)


def _write(state_dict: dict[str, Any], tmp: Path) -> str | None:
    """Every rank: DCP writes its shards into ``tmp``; what failed, or ``None``."""
    try:
        dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
    except (Exception, CheckpointException) as exc:
        # DCP wraps per-rank failures (ENOSPC included) in CheckpointException, a
        # BaseException that ``except Exception`` would miss.
        cause = _os_error_in(exc) or _full_disk(tmp, state_dict)
        if cause is not None:
            return describe_os_error(cause, tmp, "write sharded checkpoint")
        return (
            f"cannot write sharded checkpoint {tmp}: {_summary(exc)}; previous "
            "checkpoints are intact"
        )
    return None


def _records(tmp: Path) -> tuple[FileRecord, ...]:
    """Rank 0: the records of the files DCP wrote (made ``0600`` first)."""
    paths = [p for p in sorted(tmp.iterdir()) if p.is_file()]
    for p in paths:
        os.chmod(p, 0o600)  # DCP creates files with the umask's mode
    return tuple(FileRecord(p.name, *crc32_file(p)) for p in paths)


def load_sharded(
    manager: CheckpointManager, state_dict: dict[str, Any], *, step: int | None = None
) -> Manifest | None:
    """Load the newest verified sharded checkpoint (or ``step``) into ``state_dict`` in place.

    DTensor/ShardedTensor entries are resharded to their current placement, whatever the
    world size at save time.

    Returns:
        The manifest of the loaded checkpoint, or ``None`` if there is none.

    Raises:
        CheckpointCorruptError: the requested ``step`` is damaged (all ranks raise).
        UntrustedCheckpointError: a checkpoint path is not owned by this user or is
            writable by others (all ranks raise; nothing was unpickled).
        ForeignRunError: the directory holds another run's checkpoints (all ranks raise).
        CheckpointReadError: an I/O or memory error (all ranks raise; nothing skipped).
        CheckpointError: the checkpoint changed after rank 0 verified it, or DCP could not
            load it into ``state_dict`` (all ranks raise).
    """
    rank, _ = _require_pg()
    store = manager.store
    chosen: int | None = None
    identity: int | None = None
    failure: CheckpointError | None = None
    held: CheckpointDir | None = None
    try:
        if rank == 0:
            try:
                chosen, identity, held = _choose(manager, step)
            except CheckpointError as exc:
                failure = exc
        chosen, identity, message = _broadcast([chosen, identity, failure_message(failure)])
        failure = failure if rank == 0 else failure_of(message)
        if failure is not None:
            raise failure
        if chosen is not None and type(chosen) is not int:
            raise CheckpointError(f"rank 0 chose checkpoint {chosen!r:.40}, not a step number")
        if chosen is None:
            return None
        path = store.step_path(chosen)
        manifest: Manifest | None = None
        error: CheckpointError | None = None
        try:
            if held is None:  # every rank holds the directory it checks and DCP reads
                held = store.open_checkpoint(chosen)
            manifest = store.verify(chosen, deep=False, at=held)  # owner, mode, run, sizes
            if _identity(manifest) != identity:
                raise CheckpointError(
                    f"checkpoint {path} changed after rank 0 verified it (another "
                    "manifest is there now: the directory was replaced or renamed); "
                    "nothing was loaded: load again, and check who else can rename "
                    f"entries of {store.directory.parent}"
                )
        except CheckpointError as exc:
            error = exc
        # every rank's verdict before any rank starts DCP (a lone failure would hang it)
        failures = exchange.all_gather(failure_message(error))
        first = next((failure_of(f) for f in failures if f is not None), None)
        if first is not None:
            raise first
        if manifest is None or held is None:  # an internal invariant, not input
            raise CheckpointError(f"checkpoint step {chosen} was not opened on this rank")
        try:
            dcp.load(state_dict, storage_reader=dcp.FileSystemReader(held.proc_path))
        except (Exception, CheckpointException) as exc:
            cause = _os_error_in(exc)
            if cause is not None:
                raise read_error(cause, f"sharded checkpoint {path}") from exc
            raise CheckpointError(
                f"cannot load sharded checkpoint {path} into this state_dict: {_summary(exc)}"
            ) from exc
    finally:
        if held is not None:
            held.close()
    log.info("sharded checkpoint step %d loaded from %s", manifest.step, path)
    events.emit(events.CheckpointLoaded(step=manifest.step, path=str(path), format="sharded"))
    return manifest


def _choose(
    manager: CheckpointManager, step: int | None
) -> tuple[int | None, int | None, CheckpointDir | None]:
    """Rank 0: the newest verified sharded checkpoint (or ``step``), its fingerprint and
    its held directory (kept for the load: what was verified is what DCP reads)."""
    store = manager.store

    def read(info: CheckpointInfo) -> tuple[int, int, CheckpointDir] | None:
        held = store.open_checkpoint(info.step)  # a link raises: never read through
        try:
            # every file (DCP's pickled .metadata included): owner, mode, CRC32, run,
            # before torch reads any of it
            manifest = store.verify(info.step, deep=True, at=held)
        except BaseException:
            held.close()
            raise
        if manifest.kind == "sharded":
            return info.step, _identity(manifest), held
        held.close()
        return None

    found = newest(store, read, step=step)
    return found if found is not None else (None, None, None)
