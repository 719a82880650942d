"""The checkpoint store: the only code that touches a checkpoint directory (torch-free).

Names in a checkpoint directory::

    step_<N>/                             a committed checkpoint (listed, loadable)
    .tmp-step_<N>-<id>-<pid>@<host>/      a save in progress, or one that died
    .replaced-step_<N>-<id>-<pid>@<host>/ the old copy while step N is saved again
    .trash-step_<N>-<id>-<pid>@<host>/    a checkpoint being deleted by retention

The store owns these names, the commit (a directory rename), the listing, retention and
verification. The serializer writes data files into the temporary directory that
:meth:`CheckpointStore.begin` returns; the replicated (:mod:`~slurm_elastic.checkpoint.manager`)
and sharded (:mod:`~slurm_elastic.checkpoint.sharded`) front ends use only this module's
public API. The on-disk format and why it is safe: :mod:`slurm_elastic.checkpoint.manifest`.

Crash safety beyond the commit rename:

* Leftovers name their writer (pid and host). Before each save, leftovers of *dead*
  writers are removed (a writer on this host is dead when its pid is gone; on another host,
  when nothing in its directory changed for :data:`STALE_AFTER_S`), so a killed save never
  keeps a full disk full.
* A re-save of step N moves the old copy aside, renames the new one in, then deletes the
  old copy. If the writer dies between the two renames, :meth:`CheckpointStore.recover`
  (run before each save and load) renames the complete old copy back.
* Retention first renames ``step_<N>`` to a ``.trash-`` name, then deletes it: a listing
  never shows a partly deleted checkpoint.
"""

from __future__ import annotations

import builtins
import errno
import logging
import math
import operator
import os
import re
import shutil
import socket
import time
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
    sync_checkpoint,
    verify_checkpoint,
    write_manifest,
)
from slurm_elastic.checkpoint.trust import check_private, make_private_dir
from slurm_elastic.errors import CheckpointCorruptError, CheckpointError

__all__ = [
    "REPLACED_PREFIX",
    "STALE_AFTER_S",
    "TMP_PREFIX",
    "TRASH_PREFIX",
    "CheckpointInfo",
    "CheckpointStore",
    "checked_metadata",
    "checked_step",
    "describe_os_error",
]

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-step_"
REPLACED_PREFIX = ".replaced-step_"
TRASH_PREFIX = ".trash-step_"
#: A leftover of a writer on another host is stale when nothing in it changed for this long.
STALE_AFTER_S = 900.0
_LEFTOVER_RE = re.compile(
    r"^\.(?P<kind>tmp|replaced|trash)-step_(?P<step>\d+)-[0-9a-f]{12}"
    r"(?:-(?P<pid>\d+)@(?P<host>[^/]+))?$"
)


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


def _remove_tree(path: Path) -> None:
    """Remove a directory file by file (crash point ``mid_retention`` after the first)."""
    for n, entry in enumerate(sorted(os.scandir(path), key=lambda e: e.name)):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
        if n == 0:
            _faults.point("mid_retention")
    os.rmdir(path)


def _newest_mtime(path: Path) -> float:
    newest = path.lstat().st_mtime
    for entry in os.scandir(path):
        try:
            newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
        except FileNotFoundError:
            continue
    return newest


class CheckpointStore:
    """One run's checkpoint directory: temporary names, commit, listing, retention, verify.

    Args:
        directory: where ``step_<N>/`` directories live (created ``0700`` by :meth:`begin`).
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
        self._host = socket.gethostname()
        self._active: set[str] = set()  # our own in-flight temporaries (never stale)

    def step_path(self, step: int) -> Path:
        """The committed directory of ``step`` (it may not exist)."""
        return self.directory / step_dir_name(step)

    def _name(self, prefix: str, step: int) -> str:
        return f"{prefix}{step}-{uuid.uuid4().hex[:12]}-{os.getpid()}@{self._host}"

    # ------------------------------------------------------------------ leftovers
    def _entries(self) -> builtins.list[str]:
        try:
            return os.listdir(self.directory)
        except FileNotFoundError:
            return []
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                check_private(self.directory, directory=True, follow=True)  # clear message
            raise

    def _writer_dead(self, name: str) -> bool:
        match = _LEFTOVER_RE.match(name)
        if match is None:
            return False
        pid, host = match.group("pid"), match.group("host")
        if pid is not None and host == self._host:
            if int(pid) == os.getpid():
                return name not in self._active
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
            return False
        try:  # another host (or an older name without a writer): judge by activity
            return time.time() - _newest_mtime(self.directory / name) > STALE_AFTER_S
        except OSError:
            return False

    def leftovers(self) -> builtins.list[Path]:
        """Every ``.tmp-``, ``.replaced-`` and ``.trash-`` entry (live or dead writers)."""
        prefixes = (TMP_PREFIX, REPLACED_PREFIX, TRASH_PREFIX)
        return sorted(self.directory / n for n in self._entries() if n.startswith(prefixes))

    def incomplete(self) -> builtins.list[Path]:
        """Leftovers of interrupted saves (``.tmp-step_*``, ``.replaced-step_*``)."""
        return [p for p in self.leftovers() if not p.name.startswith(TRASH_PREFIX)]

    def warn_incomplete(self) -> None:
        """Log a WARNING naming each leftover of an interrupted save (they are never loaded)."""
        for leftover in self.incomplete():
            log.warning("ignoring %s: an interrupted checkpoint save (never committed)", leftover)

    def recover(self) -> builtins.list[int]:
        """Rename back the old copy of a re-save whose writer died between its two renames.

        Returns:
            The steps recovered.
        """
        recovered = []
        for path in self.leftovers():
            match = _LEFTOVER_RE.match(path.name)
            if match is None or match.group("kind") != "replaced":
                continue
            step = int(match.group("step"))
            final = self.step_path(step)
            if final.exists() or not self._writer_dead(path.name):
                continue
            try:
                read_manifest(path)  # a committed copy: it has its manifest
                os.rename(path, final)
                fsync_dir(self.directory)
            except (OSError, CheckpointCorruptError) as exc:
                log.warning("cannot recover checkpoint step %d from %s: %s", step, path, exc)
                continue
            log.warning(
                "recovered checkpoint %s from %s (a re-save of step %d died between its "
                "two renames)",
                final,
                path,
                step,
            )
            recovered.append(step)
        return recovered

    def remove_stale(self) -> builtins.list[Path]:
        """Remove leftovers of dead writers (after :meth:`recover`); return those that stay.

        Run before writing, so that a save that died never keeps a full disk full.
        """
        self.recover()
        remaining = []
        for path in self.leftovers():
            if not self._writer_dead(path.name):
                remaining.append(path)
                continue
            if not path.name.startswith(TRASH_PREFIX):
                log.warning("removing %s, left by an interrupted checkpoint save", path)
            try:
                shutil.rmtree(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot remove %s: %s", path, exc)
                remaining.append(path)
        return remaining

    # ------------------------------------------------------------------ write
    def begin(self, step: int) -> Path:
        """Create and return a fresh private temporary directory for a save of ``step``.

        First creates the checkpoint directory (``0700``) if needed, recovers interrupted
        re-saves and removes leftovers of dead writers.

        Raises:
            UntrustedCheckpointError: the directory is not ours or writable by others.
            OSError: the directory cannot be created (the caller words the error).
        """
        make_private_dir(self.directory)
        self.remove_stale()
        tmp = self.directory / self._name(TMP_PREFIX, step)
        os.mkdir(tmp, 0o700)
        self._active.add(tmp.name)
        return tmp

    def commit(self, tmp: Path, manifest: Manifest) -> Path:
        """Write ``manifest`` into ``tmp``, make ``tmp`` durable, rename it to ``step_<N>``.

        The data files need not be fsynced yet: they, the manifest and ``tmp`` are fsynced
        together (concurrently) before the rename.

        Saving a step that exists moves the old copy aside first; :meth:`recover` restores
        it if the writer dies before the new copy is renamed in.

        Raises:
            OSError: the manifest or the rename failed (``tmp`` is left for :meth:`discard`).
        """
        _faults.point("before_manifest")
        write_manifest(tmp, manifest, sync=False)
        sync_checkpoint(tmp, manifest)  # data files, manifest and tmp: all durable first
        _faults.point("before_commit")
        final = self.step_path(manifest.step)
        if final.exists():
            aside = self.directory / self._name(REPLACED_PREFIX, manifest.step)
            log.warning("checkpoint %s exists; replacing it (old copy: %s)", final, aside)
            os.rename(final, aside)
            _faults.point("between_renames")
            os.rename(tmp, final)
            fsync_dir(self.directory)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, final)
            fsync_dir(self.directory)
        self._active.discard(tmp.name)
        _faults.point("after_commit")
        return final

    def discard(self, tmp: Path) -> Path | None:
        """Remove the temporary directory of a failed save.

        Returns:
            ``tmp`` if it could not be removed (for the error message), else ``None``.
        """
        self._active.discard(tmp.name)
        try:
            shutil.rmtree(tmp)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if tmp.exists():
                log.warning("cannot remove the partial checkpoint %s: %s", tmp, exc)
                return tmp
        return None

    # ------------------------------------------------------------------ list / retention
    def list_checkpoints(self) -> builtins.list[CheckpointInfo]:
        """Committed checkpoints, oldest first (damaged ones have ``manifest=None``)."""
        infos: builtins.list[CheckpointInfo] = []
        for name in self._entries():
            step = parse_step_dir(name)
            path = self.directory / name
            if step is None or not path.is_dir():
                continue
            try:
                manifest: Manifest | None = read_manifest(path)
            except CheckpointCorruptError:
                manifest = None
            infos.append(CheckpointInfo(step, path, manifest))
        infos.sort(key=lambda i: i.step)
        return infos

    def apply_retention(self, just_saved: int) -> None:
        """Delete old checkpoints; never one at or after ``just_saved`` (verified by
        construction, so the newest verified checkpoint is never touched).

        Each is first renamed to a ``.trash-`` name (atomic: it leaves the listing whole),
        then deleted.
        """
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
            trash = self.directory / self._name(TRASH_PREFIX, info.step)
            try:
                os.rename(info.path, trash)
                fsync_dir(self.directory)
                _remove_tree(trash)
            except OSError as exc:
                log.warning("retention could not remove %s: %s", info.path, exc)
            events.emit(events.CheckpointRemoved(step=info.step, path=str(info.path)))

    # ------------------------------------------------------------------ verify
    def verify(self, step: int, *, deep: bool = True) -> Manifest:
        """Verify committed checkpoint ``step`` (sizes; with ``deep`` every CRC32 too).

        Also checks that the directory, the manifest and every data file are owned by this
        user and not writable by others (nothing else is ever read).

        Raises:
            CheckpointCorruptError: missing, incomplete or damaged (naming what).
            UntrustedCheckpointError: a path is not ours or writable by others.
        """
        path = self.step_path(step)
        try:
            check_private(self.directory, directory=True, follow=True)
            check_private(path, directory=True)
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"checkpoint {path} does not exist") from exc
        manifest = verify_checkpoint(path, deep=deep, check=_check_file)
        return manifest

    def report_damaged(self, info: CheckpointInfo, exc: Exception) -> None:
        """Log (WARNING) and emit that a damaged checkpoint is skipped (it is never deleted)."""
        log.warning("skipping damaged checkpoint %s: %s", info.path, exc)
        events.emit(events.CheckpointSkipped(step=info.step, path=str(info.path), error=str(exc)))

    def latest_verified(self, *, deep: bool = True) -> CheckpointInfo | None:
        """The newest committed checkpoint that verifies; damaged ones are skipped with a
        WARNING naming them (and never deleted). Recovers interrupted re-saves first.

        Raises:
            UntrustedCheckpointError: a checkpoint is not ours or writable by others.
        """
        self.recover()
        self.warn_incomplete()
        for info in reversed(self.list_checkpoints()):
            try:
                manifest = self.verify(info.step, deep=deep)
            except CheckpointCorruptError as exc:
                self.report_damaged(info, exc)
                continue
            return CheckpointInfo(info.step, info.path, manifest)
        return None


def _check_file(path: Path) -> None:
    try:
        check_private(path, directory=False)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"checkpoint file {path} is missing") from exc
