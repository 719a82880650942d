"""The checkpoint store: the only code that touches a checkpoint directory (torch-free).

It owns the names (``step_<N>/`` committed, ``.tmp-step_<N>-<id>/`` in progress,
``.replaced-step_<N>-<id>/`` an old copy during a re-save), the commit (a directory rename),
the listing, retention and verification. The serializer writes data files into the
temporary directory that :meth:`CheckpointStore.begin` returns; the replicated
(:mod:`~slurm_elastic.checkpoint.manager`) and sharded (:mod:`~slurm_elastic.checkpoint.sharded`)
front ends use only this module's public API. The on-disk format and why it is safe:
:mod:`slurm_elastic.checkpoint.manifest`.
"""

from __future__ import annotations

import builtins
import errno
import logging
import math
import operator
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_elastic import events
from slurm_elastic.checkpoint import _faults
from slurm_elastic.checkpoint.manifest import (
    Manifest,
    fsync_dir,
    parse_step_dir,
    read_manifest,
    step_dir_name,
    verify_checkpoint,
    write_manifest,
)
from slurm_elastic.errors import CheckpointCorruptError, CheckpointError

__all__ = [
    "REPLACED_PREFIX",
    "TMP_PREFIX",
    "CheckpointInfo",
    "CheckpointStore",
    "checked_metadata",
    "checked_step",
    "describe_os_error",
]

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-step_"
REPLACED_PREFIX = ".replaced-step_"


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint directory as listed by :meth:`CheckpointStore.list_checkpoints`.

    ``manifest`` is ``None`` when it cannot be read (the checkpoint is damaged).
    """

    step: int
    path: Path
    manifest: Manifest | None


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


class CheckpointStore:
    """One run's checkpoint directory: temporary names, commit, listing, retention, verify.

    Args:
        directory: where ``step_<N>/`` directories live (created by :meth:`begin`).
        keep_last: keep this many newest checkpoints (``None``: keep all).
        keep_every: additionally keep every checkpoint whose step is a multiple of this.

    Raises:
        CheckpointError: ``keep_last``/``keep_every`` < 1.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_last: int | None = 3,
        keep_every: int | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last} must be >= 1 (or None to keep all)")
        if keep_every is not None and keep_every < 1:
            raise CheckpointError(f"keep_every={keep_every} must be >= 1 (or None)")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.keep_every = keep_every

    def step_path(self, step: int) -> Path:
        """The committed directory of ``step`` (it may not exist)."""
        return self.directory / step_dir_name(step)

    # ------------------------------------------------------------------ write
    def begin(self, step: int) -> Path:
        """Create and return a fresh temporary directory for a save of ``step``.

        Raises:
            OSError: the directory cannot be created (the caller words the error).
        """
        tmp = self.directory / f"{TMP_PREFIX}{step}-{uuid.uuid4().hex[:12]}"
        self.directory.mkdir(parents=True, exist_ok=True)
        os.mkdir(tmp, 0o755)
        return tmp

    def commit(self, tmp: Path, manifest: Manifest) -> Path:
        """Write ``manifest`` into ``tmp`` durably and rename ``tmp`` to ``step_<N>``.

        Saving a step that exists moves the old copy aside first, so that a crash in
        between leaves one complete copy.

        Raises:
            OSError: the manifest or the rename failed (``tmp`` is left for :meth:`discard`).
        """
        _faults.point("before_manifest")
        write_manifest(tmp, manifest)
        fsync_dir(tmp)
        _faults.point("before_commit")
        final = self.step_path(manifest.step)
        if final.exists():
            aside = self.directory / f"{REPLACED_PREFIX}{manifest.step}-{uuid.uuid4().hex[:12]}"
            log.warning("checkpoint %s exists; replacing it (old copy: %s)", final, aside)
            os.rename(final, aside)
            _faults.point("between_renames")
            os.rename(tmp, final)
            fsync_dir(self.directory)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, final)
            fsync_dir(self.directory)
        _faults.point("after_commit")
        return final

    def discard(self, tmp: Path) -> None:
        """Remove a temporary directory of a failed save (best effort)."""
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

    def warn_incomplete(self) -> None:
        """Log a WARNING naming each leftover of an interrupted save (they are never loaded)."""
        for leftover in self.incomplete():
            log.warning("ignoring %s: an interrupted checkpoint save (never committed)", leftover)

    def apply_retention(self, just_saved: int) -> None:
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

    # ------------------------------------------------------------------ verify
    def verify(self, step: int, *, deep: bool = True) -> Manifest:
        """Verify committed checkpoint ``step`` (sizes; with ``deep`` every CRC32 too).

        Raises:
            CheckpointCorruptError: missing, incomplete or damaged (naming what).
        """
        path = self.step_path(step)
        if not path.is_dir():
            raise CheckpointCorruptError(f"checkpoint {path} does not exist")
        return verify_checkpoint(path, deep=deep)

    def report_damaged(self, info: CheckpointInfo, exc: Exception) -> None:
        """Log (WARNING) and emit that a damaged checkpoint is skipped (it is never deleted)."""
        log.warning("skipping damaged checkpoint %s: %s", info.path, exc)
        events.emit("checkpoint.skipped", step=info.step, path=str(info.path), error=str(exc))

    def latest_verified(self, *, deep: bool = True) -> CheckpointInfo | None:
        """The newest committed checkpoint that verifies; damaged ones are skipped with a
        WARNING naming them (and never deleted)."""
        self.warn_incomplete()
        for info in reversed(self.list_checkpoints()):
            try:
                manifest = self.verify(info.step, deep=deep)
            except CheckpointCorruptError as exc:
                self.report_damaged(info, exc)
                continue
            return CheckpointInfo(info.step, info.path, manifest)
        return None
