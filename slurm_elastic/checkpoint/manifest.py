"""The on-disk layout of one checkpoint and its manifest (the commit record).

Layout under a checkpoint directory ``<dir>``::

    <dir>/step_<N>/manifest.json      the commit record, written last
    <dir>/step_<N>/<data files>       state.pt (replicated) or DCP files (sharded)
    <dir>/.tmp-step_<N>-<id>-<pid>@<host>/   a save in progress (or one killed mid-way)

(the other leftover names are described in :mod:`slurm_elastic.checkpoint.store`).

A save writes everything into ``.tmp-step_<N>-<uuid>/`` (data, then the manifest), fsyncs
each file and the directory, and then renames the directory to ``step_<N>`` and fsyncs
``<dir>``. Why a directory rename rather than "write ``step_<N>/`` in place, manifest last":

* ``rename(2)`` of a directory within one parent is atomic on local filesystems, on Lustre
  (one MDS operation) and on NFS (one server-side RENAME); readers that list ``step_*``
  therefore only ever see complete checkpoints, with no reliance on the reader checking
  for a marker first, and no half-written ``step_<N>`` that a careless tool (or a
  user's ``ls | tail -1``) could pick up.
* The manifest still lives inside and carries sizes and CRC32s of every data file, so a
  committed checkpoint that was later truncated or bit-flipped (a torn copy, a failing
  OST) is detected on load. Commit = rename; integrity = manifest.

Only ``rename``, ``fsync`` and ``mkdir`` are relied upon for the commit: no ``flock``
(unsafe on Lustre with ``localflock``), no hard links.

The manifest protects itself: ``manifest_crc32`` covers every other field, the text must be
exactly the canonical form we wrote, and every field is type-checked, so any damage reads
as :class:`~slurm_elastic.errors.CheckpointCorruptError` ("skip it"), never as a crash.

CRC32 was chosen over BLAKE2b because it is fast enough to compute while writing without
lowering save bandwidth (:func:`crc32`: ISA-L's hardware-accelerated CRC32 from the
``isal`` package, ~12 GB/s here, else ``zlib.crc32``, 1.3-3 GB/s; the same values); it
detects truncation and bit flips, which is its job (it is not a defence against tampering:
that is the ownership rule of :mod:`slurm_elastic.checkpoint.trust`).

A manifest names its run (format 3: ``run``, the run id, ``null`` outside a run), so a
run never resumes from or prunes another run's checkpoints (the store checks it).
Manifests written before (formats 1 and 2, no ``run``) still load: they name no run.

Reading: only our own format's evidence (a missing file the manifest names, a size, a
CRC32, a manifest that does not parse) raises
:class:`~slurm_elastic.errors.CheckpointCorruptError`; an I/O or memory error raises
:class:`~slurm_elastic.checkpoint.trust.CheckpointReadError` (the checkpoint is not
damaged and stays). Every data file read for a CRC32 passes the fault point
``"read_file"`` (:mod:`slurm_elastic.checkpoint._faults`, tests only) right after it is
opened.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import operator
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_elastic.checkpoint import _faults
from slurm_elastic.checkpoint.trust import CheckpointDir, UntrustedCheckpointError, read_error
from slurm_elastic.errors import CheckpointCorruptError, CheckpointError
from slurm_elastic.privatefs import DIR_FLAGS, READ_FLAGS, write_new
from slurm_elastic.privatefs.records import crc32

__all__ = [
    "MANIFEST_NAME",
    "FileRecord",
    "Manifest",
    "checked_metadata",
    "checked_step",
    "crc32",
    "crc32_fd",
    "crc32_file",
    "fsync_dir",
    "parse_step_dir",
    "read_manifest",
    "step_dir_name",
    "sync_checkpoint",
    "verify_checkpoint",
    "write_manifest",
]

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 3
_MAX_RUN_CHARS = 256
_SAFE_NAME = re.compile(r"^(?!\.\.?$)[^/\x00]{1,255}$")
_MAX_MANIFEST_BYTES = 64 << 20
_STEP_RE = re.compile(r"^step_(\d+)$")
_CHUNK = 8 << 20


def step_dir_name(step: int) -> str:
    """Return the committed directory name for ``step`` (``step_<N>``)."""
    return f"step_{step}"


def parse_step_dir(name: str) -> int | None:
    """Return the step encoded in a committed directory name, or ``None`` if it is not one."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class FileRecord:
    """One data file of a checkpoint: its name (relative), size in bytes and CRC32."""

    name: str
    bytes: int
    crc32: int


@dataclass(frozen=True)
class Manifest:
    """The commit record of one checkpoint.

    Attributes:
        step: the training step the checkpoint belongs to.
        kind: ``"replicated"`` (one data file written by rank 0) or ``"sharded"``
            (``torch.distributed.checkpoint`` files written by every rank).
        world_size: the number of ranks at save time.
        files: every data file with size and CRC32.
        created: Unix time of the commit.
        metadata: small JSON-able user fields (epoch, sample offset, ...).
        run: the run id of the run that wrote it (``None``: written outside a run, or
            before manifests named their run: formats 1 and 2).
    """

    step: int
    kind: str
    world_size: int
    files: tuple[FileRecord, ...]
    created: float = field(default_factory=time.time)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    run: str | None = None

    @property
    def total_bytes(self) -> int:
        """Sum of the data file sizes."""
        return sum(f.bytes for f in self.files)

    def _body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "format_version": self.format_version,
            "step": self.step,
            "kind": self.kind,
            "world_size": self.world_size,
            "created": self.created,
            "total_bytes": self.total_bytes,
            "files": [{"name": f.name, "bytes": f.bytes, "crc32": f.crc32} for f in self.files],
            "metadata": dict(self.metadata),
        }
        if self.format_version >= 3:
            body["run"] = self.run
        return body

    def to_json(self) -> str:
        """Serialize to the JSON text stored in ``manifest.json``, with its own CRC32.

        ``manifest_crc32`` covers every other field (the canonical compact JSON of them),
        so damage to any byte of the manifest is detected on read.
        """
        body = self._body()
        body["manifest_crc32"] = _body_crc(body)
        return json.dumps(body, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, source: Path) -> Manifest:
        """Parse and check manifest text.

        Every field is covered by ``manifest_crc32`` and type-checked; file names must be
        plain names inside the checkpoint directory.

        Raises:
            CheckpointCorruptError: naming ``source`` and what is wrong (never another error).
        """
        try:
            return cls._parse(text)
        except CheckpointCorruptError as exc:
            raise CheckpointCorruptError(
                f"checkpoint manifest {source} is damaged ({exc}); the checkpoint will not "
                "be loaded"
            ) from exc
        except MemoryError as exc:  # the node's, not the manifest's
            raise read_error(exc, f"checkpoint manifest {source}") from exc
        except Exception as exc:  # any damage is "skip it", never a crash
            raise CheckpointCorruptError(
                f"checkpoint manifest {source} is unreadable ({type(exc).__name__}: {exc}); "
                "the checkpoint is incomplete or damaged and will not be loaded"
            ) from exc

    @classmethod
    def _parse(cls, text: str) -> Manifest:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise CheckpointCorruptError("not a JSON object")
        version = raw.get("format_version")
        if version not in (2, FORMAT_VERSION) and not (
            version == 1 and "manifest_crc32" not in raw
        ):
            raise CheckpointCorruptError(f"format_version={version!r} is not supported")
        if "manifest_crc32" in raw or version != 1:
            stored = raw.pop("manifest_crc32", None)
            if type(stored) is not int or stored != _body_crc(raw):
                raise CheckpointCorruptError("its own CRC32 does not match (changed bytes)")
        expected = {"format_version", "step", "kind", "world_size", "created", "total_bytes"}
        expected |= {"files", "metadata"}
        if version >= 3:
            expected.add("run")
        if set(raw) != expected:
            raise CheckpointCorruptError(f"fields {sorted(raw)} != {sorted(expected)}")
        files_raw = raw["files"]
        if not isinstance(files_raw, list) or not files_raw:
            raise CheckpointCorruptError("files must be a non-empty list")
        files = []
        for f in files_raw:
            if not isinstance(f, dict) or set(f) != {"name", "bytes", "crc32"}:
                raise CheckpointCorruptError(f"bad file record {f!r}")
            name, size, crc = f["name"], f["bytes"], f["crc32"]
            if not isinstance(name, str) or not _SAFE_NAME.match(name) or name == MANIFEST_NAME:
                raise CheckpointCorruptError(f"file name {name!r} is not a plain data file name")
            if not _is_int(size) or size < 0 or not _is_int(crc) or not 0 <= crc < 1 << 32:
                raise CheckpointCorruptError(f"bad size/CRC32 in file record {f!r}")
            files.append(FileRecord(name, size, crc))
        step, world, created = raw["step"], raw["world_size"], raw["created"]
        if not _is_int(step) or step < 0 or not _is_int(world) or world < 1:
            raise CheckpointCorruptError(f"bad step={step!r} or world_size={world!r}")
        if raw["kind"] not in ("replicated", "sharded"):
            raise CheckpointCorruptError(f"unknown kind={raw['kind']!r}")
        if not isinstance(created, (int, float)) or isinstance(created, bool):
            raise CheckpointCorruptError(f"bad created={created!r}")
        if not isinstance(raw["metadata"], dict):
            raise CheckpointCorruptError("metadata is not an object")
        run = raw.get("run")
        if run is not None and not (
            type(run) is str and 0 < len(run) <= _MAX_RUN_CHARS and run.isprintable()
        ):
            raise CheckpointCorruptError(f"bad run={run!r:.80}")
        manifest = cls(
            step=step,
            kind=raw["kind"],
            world_size=world,
            files=tuple(files),
            created=float(created),
            metadata=raw["metadata"],
            format_version=version,
            run=run,
        )
        if raw["total_bytes"] != manifest.total_bytes:
            raise CheckpointCorruptError("total_bytes does not match the file records")
        if version != 1 and manifest.to_json() != text:
            # e.g. a changed last digit of a float that parses to the same value: the
            # bytes still differ from what was written, so the file was changed.
            raise CheckpointCorruptError("its bytes differ from the canonical form written")
        return manifest


def _is_int(value: object) -> bool:
    return type(value) is int


def _body_crc(body: Mapping[str, Any]) -> int:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return crc32(canonical.encode())


def checked_step(step: object) -> int:
    """Return ``step`` as a plain ``int`` >= 0, or refuse it before anything is written.

    Integral values are accepted: ``int``, numpy integers, 0-d integer tensors (anything
    with ``__index__`` and no dimensions). ``bool`` and floats (even ``5.0``) are refused:
    they would name a directory (``step_True``, ``step_5.0``) that no listing recognises.

    Raises:
        CheckpointError: naming the value and the fix.
    """
    kind = type(step).__name__
    if isinstance(step, bool) or kind in ("bool_", "bool"):
        raise CheckpointError(f"step={step!r} is a bool, not an integer; pass the step number")
    if getattr(step, "ndim", 0) != 0:
        raise CheckpointError(
            f"step={step!r} has {getattr(step, 'ndim', '?')} dimensions; pass one integer "
            "(int(step) or step.item())"
        )
    try:
        value = operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        raise CheckpointError(
            f"step={step!r} ({kind}) is not an integer; pass an int (e.g. int(step) if it "
            "is integral)"
        ) from None
    if value < 0:
        raise CheckpointError(f"step={value} must be >= 0")
    return value


def checked_metadata(metadata: object) -> dict[str, Any]:
    """Return ``metadata`` as a JSON-able dict, or refuse it before anything is written.

    Allowed: dicts with ``str`` keys, lists/tuples, ``str``, ``int``, finite ``float``,
    ``bool``, ``None``. Tensors and numpy scalars are refused (call ``.item()``).

    Raises:
        CheckpointError: naming the offending key and value.
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"metadata={metadata!r} must be a dict of JSON values")

    def check(value: object, where: str) -> None:
        if value is None or isinstance(value, (str, bool, int)):
            return
        if isinstance(value, float):
            if not math.isfinite(value):
                raise CheckpointError(f"metadata{where}={value!r} is not finite (JSON has no NaN)")
            return
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                check(item, f"{where}[{i}]")
            return
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise CheckpointError(
                        f"metadata{where} has the key {key!r} ({type(key).__name__}); "
                        "JSON keys are strings: use str keys"
                    )
                check(item, f"{where}[{key!r}]")
            return
        raise CheckpointError(
            f"metadata{where}={value!r} ({type(value).__name__}) is not a JSON value; "
            "store plain numbers and strings (e.g. tensor.item(), int(x))"
        )

    check(metadata, "")
    return dict(metadata)


def fsync_dir(path: Path) -> None:
    """fsync a directory so that entries created/renamed in it are durable."""
    fd = os.open(path, DIR_FLAGS)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path, manifest: Manifest, *, sync: bool = True) -> None:
    """Write ``directory/manifest.json`` (a new file in a private temporary directory).

    ``sync``: fsync it (the commit instead fsyncs it together with the data files,
    :func:`sync_checkpoint`).
    """
    write_new(directory / MANIFEST_NAME, manifest.to_json().encode(), fsync=sync)


_sync_pool: tuple[int, ThreadPoolExecutor] | None = None
_sync_lock = threading.Lock()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, READ_FLAGS)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_checkpoint(directory: Path, manifest: Manifest) -> None:
    """fsync every data file of ``manifest``, the manifest and ``directory``, concurrently.

    Issued together, the fsyncs share the filesystem's journal commits (on ext4 three
    sequential fsyncs cost about twice as much as the data file's alone). Returns when
    all are durable.

    Raises:
        OSError: the first fsync that failed.
    """
    global _sync_pool
    paths = [directory / f.name for f in manifest.files]
    paths += [directory / MANIFEST_NAME, directory]
    with _sync_lock:
        if _sync_pool is None or _sync_pool[0] != os.getpid():  # a forked child: its own
            _sync_pool = (os.getpid(), ThreadPoolExecutor(4, thread_name_prefix="checkpoint-fsync"))
        pool = _sync_pool[1]
    futures = [pool.submit(_fsync_path, p) for p in paths]
    errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error


def _open_by_path(path: Path) -> int:
    """Open ``path`` for reading without following a link at it (no ownership check)."""
    try:
        return os.open(path, READ_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EOPNOTSUPP):
            raise UntrustedCheckpointError(
                f"checkpoint path {path} is not a regular file (a symbolic link or a "
                f"special file: {exc.strerror}); refusing to read it"
            ) from exc
        raise


def read_manifest(directory: Path, *, at: CheckpointDir | None = None) -> Manifest:
    """Read and check the manifest of a committed checkpoint directory.

    The manifest must be a regular file (not a link, FIFO or directory) of sane size, and
    its step must be the one in the directory's name.

    Args:
        directory: the checkpoint directory (its name gives the step; for messages).
        at: the same directory, held and checked: the manifest is opened relative to it
            and must be ours and not writable by others. ``None``: opened by path.

    Raises:
        CheckpointCorruptError: no manifest, or it is damaged in any way.
        UntrustedCheckpointError: it is a link or special file (or, with ``at``, not ours
            or writable by others).
        CheckpointReadError: an I/O or memory error while reading it (not damage).
    """
    path = directory / MANIFEST_NAME
    try:
        fd = at.open_file(MANIFEST_NAME) if at is not None else _open_by_path(path)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(
            f"checkpoint {directory} has no {MANIFEST_NAME}; it was not committed by "
            "slurm_elastic (or was damaged) and will not be loaded"
        ) from exc
    except OSError as exc:
        raise read_error(exc, f"manifest {path}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_MANIFEST_BYTES:
            raise CheckpointCorruptError(
                f"manifest {path} is not a regular file of at most {_MAX_MANIFEST_BYTES} bytes"
            )
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(st.st_size + 1)  # its size, not the limit: no 64 MiB buffer
    except (OSError, MemoryError) as exc:
        raise read_error(exc, f"manifest {path}") from exc
    finally:
        os.close(fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointCorruptError(f"manifest {path} is not UTF-8 text ({exc})") from exc
    manifest = Manifest.from_json(text, source=path)
    named = parse_step_dir(directory.name)
    if named is not None and named != manifest.step:
        raise CheckpointCorruptError(
            f"manifest {path} says step {manifest.step}, but the directory is step {named}"
        )
    return manifest


def crc32_mapping(mm: mmap.mmap, size: int, chunk: int = _CHUNK) -> int:
    """CRC32 of the first ``size`` bytes of a mapping, in ``chunk`` pieces, while the
    kernel reads ahead (``MADV_SEQUENTIAL``; explicit ``MADV_WILLNEED`` windows measured
    slower here)."""
    with suppress(OSError, AttributeError):
        mm.madvise(mmap.MADV_SEQUENTIAL)
    view = memoryview(mm)
    try:
        crc = 0
        for start in range(0, size, chunk):
            crc = crc32(view[start : start + chunk], crc)
    finally:
        view.release()
    return crc


def crc32_fd(fd: int) -> tuple[int, int]:
    """Return ``(size, crc32)`` of the open file ``fd``, read through a read-only mapping
    (:func:`crc32_mapping`: no copy into a user buffer). The pages stay in the page cache,
    where a following read finds them. Fault point ``"read_file"`` first (tests only).

    Raises:
        OSError: the mapping failed (``ENOMEM``, ``EIO`` ...).
    """
    _faults.point("read_file")
    size = os.fstat(fd).st_size
    if size == 0:
        return 0, 0
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mm:
        crc = crc32_mapping(mm, size)
    return size, crc


def crc32_file(path: Path) -> tuple[int, int]:
    """Return ``(size, crc32)`` of a file, read once (:func:`crc32_fd`). A symbolic link
    is refused."""
    fd = os.open(path, READ_FLAGS)
    try:
        return crc32_fd(fd)
    finally:
        os.close(fd)


def verify_checkpoint(
    directory: Path,
    *,
    deep: bool = True,
    on_progress: Callable[[str], None] | None = None,
    at: CheckpointDir | None = None,
) -> Manifest:
    """Check that a committed checkpoint is complete and intact.

    Args:
        directory: a ``step_<N>`` directory.
        deep: also recompute every file's CRC32 (reads all data); otherwise check sizes only.
        on_progress: called with each file name before it is checked (for tests/logging).
        at: ``directory`` held and checked (:class:`~slurm_elastic.checkpoint.trust.CheckpointDir`):
            the manifest and every data file are opened relative to it, without following
            links, and must be ours and not writable by others (what is checked is what
            is read). ``None``: opened by path, no ownership check.

    Returns:
        The manifest.

    Raises:
        CheckpointCorruptError: naming the directory, the file and what is wrong.
        UntrustedCheckpointError: a file is a link or special file (with ``at``: or not
            ours, or writable by others).
        CheckpointReadError: an I/O or memory error (not damage: nothing is wrong with it).
    """
    manifest = read_manifest(directory, at=at)
    for rec in manifest.files:
        if on_progress is not None:
            on_progress(rec.name)
        what = f"checkpoint {directory}: data file {rec.name}"
        try:
            fd = at.open_file(rec.name) if at is not None else _open_by_path(directory / rec.name)
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{what} is missing ({exc})") from exc
        except OSError as exc:
            raise read_error(exc, what) from exc
        try:
            if deep:
                size, crc = crc32_fd(fd)
            else:
                size, crc = os.fstat(fd).st_size, rec.crc32
        except (OSError, MemoryError) as exc:
            raise read_error(exc, what) from exc
        finally:
            os.close(fd)
        if size != rec.bytes:
            raise CheckpointCorruptError(
                f"checkpoint {directory}: {rec.name} has {size} bytes, manifest says "
                f"{rec.bytes} (truncated or overwritten)"
            )
        if crc != rec.crc32:
            raise CheckpointCorruptError(
                f"checkpoint {directory}: {rec.name} fails its CRC32 check "
                f"({crc:#010x} != {rec.crc32:#010x}; flipped bytes)"
            )
    return manifest
