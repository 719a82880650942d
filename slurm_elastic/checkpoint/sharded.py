"""Sharded (FSDP/DTensor) checkpoints through ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shards with DCP's ``FileSystemWriter`` (``sync_files=True``)
into the same ``.tmp-step_<N>-<uuid>/`` directory on the shared filesystem; rank 0 then
writes our manifest (CRC32 of every DCP file, including DCP's ``.metadata``) and commits
with the same directory rename as replicated checkpoints. DCP's own format is kept, so a
load reshards to whatever world size and placement the live ``state_dict`` has.

Both calls are collective: every rank must call them, with a process group initialized.
"""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from slurm_elastic import events
from slurm_elastic.checkpoint.manager import CheckpointManager
from slurm_elastic.checkpoint.manifest import FileRecord, Manifest, crc32_file, verify_checkpoint
from slurm_elastic.checkpoint.store import checked_metadata, checked_step, describe_os_error
from slurm_elastic.errors import CheckpointCorruptError, CheckpointError, CheckpointWriteError

__all__ = ["load_sharded", "save_sharded"]

log = logging.getLogger(__name__)


def _broadcast(value: Any) -> Any:
    box: builtins.list[Any] = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _require_pg() -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise CheckpointError(
            "sharded checkpoints need an initialized process group; call "
            "torch.distributed.init_process_group first (or use CheckpointManager.save)"
        )
    return dist.get_rank(), dist.get_world_size()


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
    start = time.perf_counter()
    error: str | None = None
    tmp_name: str | None = None
    if rank == 0:
        try:
            tmp_name = store.begin(step).name
        except OSError as exc:
            error = describe_os_error(exc, store.directory, "create sharded checkpoint in")
    tmp_name = _broadcast(tmp_name)
    tmp = store.directory / (tmp_name or "(not created)")
    try:
        if tmp_name is not None:
            dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
    except OSError as exc:
        error = describe_os_error(exc, tmp, "write sharded checkpoint")
    except Exception as exc:  # DCP wraps per-rank failures in CheckpointException
        error = f"cannot write sharded checkpoint {tmp}: {exc}; previous checkpoints are intact"
    final: Path | None = None
    manifest: Manifest | None = None
    if rank == 0 and error is None:
        try:
            files = tuple(
                FileRecord(p.name, *crc32_file(p)) for p in sorted(tmp.iterdir()) if p.is_file()
            )
            manifest = Manifest(step, "sharded", world, files, metadata=meta)
            final = store.commit(tmp, manifest)
        except OSError as exc:
            error = describe_os_error(exc, tmp, "commit sharded checkpoint")
    errors = [None] * world
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first is not None:
        if rank == 0:
            store.discard(tmp)
            events.emit("checkpoint.failed", step=step, path=str(tmp), error=first)
        raise CheckpointWriteError(first)
    path = store.step_path(step)
    if rank == 0 and final is not None and manifest is not None:
        seconds = time.perf_counter() - start
        log.info(
            "sharded checkpoint step %d saved: %s (%d bytes)", step, final, manifest.total_bytes
        )
        events.emit(
            "checkpoint.saved",
            step=step,
            path=str(final),
            bytes=manifest.total_bytes,
            seconds=seconds,
            kind="sharded",
        )
        store.apply_retention(step)
    dist.barrier()  # nobody loads before the commit
    return path


def load_sharded(
    manager: CheckpointManager, state_dict: dict[str, Any], *, step: int | None = None
) -> Manifest | None:
    """Load the newest verified sharded checkpoint (or ``step``) into ``state_dict`` in place.

    DTensor/ShardedTensor entries are resharded to their current placement, whatever the
    world size at save time.

    Returns:
        The manifest of the loaded checkpoint, or ``None`` if there is none.

    Raises:
        CheckpointCorruptError: the requested ``step`` is damaged.
    """
    rank, _ = _require_pg()
    chosen: str | None = None
    if rank == 0:
        infos = [i for i in manager.list_checkpoints() if step is None or i.step == step]
        for info in reversed(infos):
            try:
                manifest = verify_checkpoint(info.path)
            except CheckpointCorruptError as exc:
                if step is not None:
                    raise
                manager.store.report_damaged(info, exc)
                continue
            if manifest.kind == "sharded":
                chosen = str(info.path)
                break
    chosen = _broadcast(chosen)
    if chosen is None:
        return None
    path = Path(chosen)
    dcp.load(state_dict, checkpoint_id=path)
    manifest = verify_checkpoint(path, deep=False)
    log.info("sharded checkpoint step %d loaded from %s", manifest.step, path)
    events.emit("checkpoint.loaded", step=manifest.step, path=str(path), kind="sharded")
    return manifest
