"""The serializer: a state tree to one data file with its CRC32, and back.

Two formats are read, told apart by the file name the manifest records; one is written:

* ``state.bin`` (:data:`STATE_FILE`, the default): our pickle-free container
  (:mod:`slurm_elastic.checkpoint.container`): a JSON header and the tensors' raw bytes,
  written straight from the tensors' memory with the CRC32 computed on a second thread.
  Loading cannot run code whatever ``weights_only`` says.
* ``state.pt`` (:data:`TORCH_FILE`): one ``torch.save`` file, only *read*: checkpoints
  written by earlier versions (which wrote it for a manager with ``weights_only=False``
  and a state the container does not store). Verified against its manifest record
  before ``torch.load`` (``weights_only`` as the manager says) sees any of it. A state
  the container does not store is refused at save, naming the value and the fix: the
  package writes two formats, this container and DCP for sharded state.

Placement: the container is parsed into CPU tensors, then moved where ``map_location``
says. A device this node lacks (``"cuda:0"`` without CUDA) or out of device memory is the
node's problem, never damage: :class:`~slurm_elastic.checkpoint.trust.CheckpointReadError`
(:func:`check_device` probes the device before anything is read).

Directory handling (names, commit, listing) belongs to :mod:`slurm_elastic.checkpoint.store`.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from slurm_elastic.checkpoint import _faults
from slurm_elastic.checkpoint.container import (
    check_encodable,
    decode_tree,
    encode,
    read_container,
    write_container,
)
from slurm_elastic.checkpoint.manifest import FileRecord, crc32_fd
from slurm_elastic.checkpoint.staging import state_nbytes
from slurm_elastic.checkpoint.trust import (
    CheckpointDir,
    CheckpointReadError,
    open_data_file,
    read_error,
)
from slurm_elastic.errors import (
    CheckpointCorruptError,
    CheckpointError,
    UnsupportedStateError,
)

__all__ = [
    "STATE_FILE",
    "TORCH_FILE",
    "check_device",
    "check_storable",
    "read_state",
    "write_state",
]

log = logging.getLogger(__name__)

STATE_FILE = "state.bin"
TORCH_FILE = "state.pt"


def _not_storable(exc: UnsupportedStateError) -> UnsupportedStateError:
    return UnsupportedStateError(
        f"the checkpoint state holds {exc}, which the checkpoint format (tensors, "
        "containers and plain values, no pickle) does not store; save its plain state "
        "instead (e.g. its state_dict(), or register it as a stateful object of "
        "TrainingState), or turn it into tensors, numbers and strings: a checkpoint "
        "never holds a pickle, which could run code when loaded"
    )


def check_storable(state: Any) -> None:
    """Refuse, before anything is staged, a state the container cannot store.

    Raises:
        UnsupportedStateError: names the value and the fix.
    """
    try:
        check_encodable(state)  # a walk of the tree; no tensor byte is read
    except UnsupportedStateError as exc:
        raise _not_storable(exc) from exc


def write_state(state: Any, directory: Path) -> FileRecord:
    """Serialize ``state`` into ``directory`` (``state.bin``, the container); return its
    record. Not fsynced here: the store's commit fsyncs every file together.

    Raises:
        OSError: the write failed (the caller names the path and the fix).
        UnsupportedStateError: a value the container does not store (anything but
            tensors, containers and plain values); names the value and the fix.
    """
    half = max(1, state_nbytes(state) // 2)
    mid_called = False

    def on_bytes(total: int) -> None:
        nonlocal mid_called
        if not mid_called and total >= half:
            mid_called = True
            _faults.point("mid_data")

    try:
        lead, tensors = encode(state)
    except UnsupportedStateError as exc:
        raise _not_storable(exc) from exc
    size, crc = write_container(directory / STATE_FILE, lead, tensors, on_bytes)
    return FileRecord(STATE_FILE, size, crc)


#: Filesystems where a mapped file keeps its directory busy (NFS "silly rename": a
#: ``.nfsXXXX`` file appears and retention's rmdir fails while a mapping lives).
_NO_MAP_FS = ("nfs", "nfs4")


def filesystem_type(path: Path) -> str:
    """The type of the filesystem ``path`` is on (``/proc/self/mountinfo``), ``""`` if unknown."""
    target = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if " - " not in line or len(fields) < 5:
                    continue
                mount = fields[4].replace("\\040", " ")
                fstype = line.split(" - ", 1)[1].split()[0]
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, fstype
    except OSError:
        return ""
    return kind


def map_by_default(directory: Path) -> bool:
    """Whether a load maps ``state.bin`` when the caller did not say: yes, except on NFS."""
    return filesystem_type(directory) not in _NO_MAP_FS


def read_state(
    directory: Path,
    record: FileRecord,
    map_location: Any,
    *,
    weights_only: bool,
    mmap: bool | None,
    at: CheckpointDir | None = None,
) -> Any:
    """Load the data file ``record`` of a checkpoint whose trust and sizes the store checked.

    Every byte is checked against the record's CRC32 before anything is parsed: the
    container verifies while it reads (one pass); a ``torch.save`` file is CRCed first,
    then ``torch.load`` reads the very file that was CRCed (``/proc/self/fd/<fd>`` of it).
    ``mmap=None`` maps a ``state.bin`` (copy-on-write; less memory and no page faults on
    fresh memory) unless the directory is on NFS, and reads a ``state.pt`` into memory.

    Args:
        directory: the checkpoint directory.
        record: the data file's manifest record.
        map_location: as for ``torch.load``.
        weights_only: passed to ``torch.load`` (``state.pt`` only).
        mmap: see above.
        at: ``directory`` held and checked by the store: the file is opened relative to
            it (no links; ours and private), so what was verified is what is read.

    Raises:
        CheckpointError: a ``torch.save`` file needs ``weights_only=False`` (never skipped
            silently: that would restart training from scratch).
        CheckpointCorruptError: a CRC32/size mismatch or a missing file, or a container
            that verified but cannot be parsed.
        CheckpointReadError: an I/O or memory error, a device that does not exist here, or
            a ``torch.save`` file that verified but ``torch.load`` cannot read (it is
            intact and stays).
    """
    path = directory / record.name
    if record.name == STATE_FILE:
        location = _location(map_location)  # a usage error: before anything is read
        parsed = read_container(
            path,
            expected_size=record.bytes,
            expected_crc=record.crc32,
            use_mmap=map_by_default(directory) if mmap is None else mmap,
            at=at,
        )
        targets = [location(saved) for saved in parsed.devices]
        if all(target == "cpu" for target in targets):
            return parsed.state
        moved = [_to_device(t, d, path) for t, d in zip(parsed.tensors, targets, strict=True)]
        return decode_tree(parsed.tree, moved)
    if record.name != TORCH_FILE:
        raise CheckpointCorruptError(f"checkpoint {directory} has no state file ({record.name})")
    fd = open_data_file(path, at)
    try:
        try:
            size, crc = crc32_fd(fd)
        except (OSError, MemoryError) as exc:
            raise read_error(exc, f"checkpoint file {path}") from exc
        if (size, crc) != (record.bytes, record.crc32):
            raise CheckpointCorruptError(
                f"checkpoint file {path} fails its size/CRC32 check ({size} bytes, "
                f"{crc:#010x}; manifest: {record.bytes} bytes, {record.crc32:#010x})"
            )
        return _torch_load(f"/proc/self/fd/{fd}", path, map_location, weights_only, mmap)
    finally:
        os.close(fd)


def _torch_load(
    source: str, path: Path, map_location: Any, weights_only: bool, mmap: bool | None
) -> Any:
    """``torch.load`` of a verified file; its failures are never "damage" (the bytes are
    exactly those written)."""
    try:
        options = {"map_location": map_location, "weights_only": weights_only, "mmap": bool(mmap)}
        return torch.load(source, **options)  # verified: size and CRC32 just matched
    except (OSError, MemoryError) as exc:
        raise read_error(exc, f"checkpoint file {path}") from exc
    except Exception as exc:
        # torch.load(weights_only=True) refuses a global outside its allowlist with
        # pickle.UnpicklingError (torch 2.13 and 2.14.1); the bytes are the ones written
        # (size and CRC32 checked), so with weights_only that is what it means.
        if weights_only and isinstance(exc, pickle.UnpicklingError):
            raise CheckpointError(
                f"checkpoint {path.parent} holds objects outside torch's weights-only "
                "allowlist; pass weights_only=False to CheckpointManager if you trust "
                f"this directory ({exc})"
            ) from exc
        raise CheckpointReadError(
            f"checkpoint file {path} is intact (size and CRC32 match its manifest) but "
            f"torch.load cannot read it here (map_location={map_location!r}; "
            f"{type(exc).__name__}: {exc}). No checkpoint was changed: load it where the "
            "device exists and with the torch version and classes it was saved with"
        ) from exc


def _to_device(t: torch.Tensor, device: str, path: Path) -> torch.Tensor:
    """Move one verified tensor; a failure is the node's (no such device, no memory)."""
    if device == "cpu":
        return t
    try:
        return t.to(device)
    except Exception as exc:  # torch raises RuntimeError, AssertionError, OutOfMemoryError
        raise CheckpointReadError(
            f"checkpoint file {path} is intact (size and CRC32 match its manifest), but its "
            f"tensors cannot be moved to device {device!r} on {socket.gethostname()} "
            f"({type(exc).__name__}: {exc}). No checkpoint was changed: load it where that "
            "device exists and has room, or pass map_location='cpu'"
        ) from exc


def check_device(map_location: Any) -> None:
    """Check that the device(s) ``map_location`` names exist on this node, before reading.

    Plain devices (``"cuda:0"``, ``torch.device``) and the targets of a dict are probed
    (an empty tensor is made there); ``None`` and callables are not.

    Raises:
        CheckpointReadError: naming the device, this host and the fix.
    """
    if isinstance(map_location, (str, torch.device)):
        targets = [str(map_location)]
    elif isinstance(map_location, dict):
        targets = sorted({str(v) for v in map_location.values()})
    else:
        return
    for target in targets:
        if target == "cpu":
            continue
        try:
            torch.empty(0, device=target)
        except Exception as exc:  # RuntimeError, AssertionError (not compiled with CUDA)
            raise CheckpointReadError(
                f"map_location={target!r} names a device this node "
                f"({socket.gethostname()}) cannot use ({type(exc).__name__}: {exc}). No "
                "checkpoint was read or changed: load where that device exists, or pass "
                "map_location='cpu'"
            ) from exc


def _location(map_location: Any) -> Callable[[str], str]:
    """Where a tensor saved from a device goes (``state.bin``; as ``torch.load`` maps).

    Raises:
        CheckpointError: a ``map_location`` this format does not support (a callable).
    """
    if map_location is None:
        return lambda saved: saved  # where it was saved from, as torch.load does
    if isinstance(map_location, (str, torch.device)):
        target = str(map_location)
        return lambda saved: target
    if isinstance(map_location, dict):
        table = {str(k): str(v) for k, v in map_location.items()}
        return lambda saved: table.get(saved, saved)
    raise CheckpointError(
        f"map_location={map_location!r} is not supported for this checkpoint format; "
        "pass a device (e.g. 'cpu', 'cuda:0') or a dict of device names"
    )
