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

Hostile neighbours (see :mod:`slurm_elastic.checkpoint.trust`):

* Every check and read goes through held descriptors; removal too, without following a
  link: a ``step_<N>`` (or a leftover) that is a symbolic link is unlinked, its target is
  never touched, and no ``.trash-`` name stays behind.
* A run is bound to its checkpoints: each manifest names its run, and a load, save or
  retention in a directory holding another run's checkpoints raises
  :class:`~slurm_elastic.checkpoint.trust.ForeignRunError` naming both runs (so a swapped
  or mis-pointed directory is never resumed from or pruned). Manifests written before
  (no run) still load; retention in a run never deletes them (they are not provably this
  run's): it keeps them with a WARNING.
"""

from __future__ import annotations

import builtins
import logging
import os
import shutil
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from slurm_elastic import events
from slurm_elastic.checkpoint import _faults
from slurm_elastic.checkpoint.leftovers import (
    LEFTOVER_PREFIXES,
    REPLACED_PREFIX,
    STALE_AFTER_S,
    TMP_PREFIX,
    TRASH_PREFIX,
    leftover_name,
    replaced_step,
    writer_dead,
)
from slurm_elastic.checkpoint.manifest import (
    Manifest,
    checked_metadata,
    checked_step,
    parse_step_dir,
    read_manifest,
    step_dir_name,
    sync_checkpoint,
    verify_checkpoint,
    write_manifest,
)
from slurm_elastic.checkpoint.trust import (
    CheckpointDir,
    check_run,
    make_private_dir,
    read_error,
)
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
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint directory as listed by :meth:`CheckpointStore.list_checkpoints`.

    ``manifest`` is ``None`` when it cannot be read (the checkpoint is damaged or
    unreadable) or when ``step_<N>`` is a symbolic link (``is_link``: never read through).
    """

    step: int
    path: Path
    manifest: Manifest | None
    is_link: bool = False


class CheckpointStore:
    """One run's checkpoint directory: temporary names, commit, listing, retention, verify.

    Every check and read goes through held directory descriptors
    (:class:`~slurm_elastic.checkpoint.trust.CheckpointDir`): the checkpoint directory is
    opened and checked once per operation, and everything in it is opened relative to it
    without following links.

    Args:
        directory: where ``step_<N>/`` directories live (created ``0700`` by :meth:`begin`).
        keep_last: keep this many newest checkpoints (``None``: keep all).
        keep_every: additionally keep every checkpoint whose step is a multiple of this.
        run_id: the run these checkpoints belong to (written into each manifest); a load,
            save or retention in a directory holding another run's checkpoints raises
            :class:`~slurm_elastic.checkpoint.trust.ForeignRunError`. ``None``: no run
            (nothing recorded, every run accepted).

    Raises:
        CheckpointError: ``keep_last``/``keep_every`` < 1.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        run_id: str | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last} must be >= 1 (or None to keep all)")
        if keep_every is not None and keep_every < 1:
            raise CheckpointError(f"keep_every={keep_every} must be >= 1 (or None)")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.run_id = run_id or None
        self._host = socket.gethostname()
        self._active: set[str] = set()  # our own in-flight temporaries (never stale)
        self._kept_unproven: set[str] = set()  # retention warned about these already

    def step_path(self, step: int) -> Path:
        """The committed directory of ``step`` (it may not exist)."""
        return self.directory / step_dir_name(step)

    def _name(self, prefix: str, step: int) -> str:
        return leftover_name(prefix, step, self._host)

    # ------------------------------------------------------------------ the held directory
    def open_root(self) -> CheckpointDir:
        """Open and check the checkpoint directory (ours, not writable by others).

        Raises:
            FileNotFoundError: it does not exist.
            UntrustedCheckpointError: not ours, or writable by others.
            CheckpointError: a symbolic link loop.
            CheckpointReadError: it cannot be opened (I/O, permission, open files).
        """
        try:
            return CheckpointDir.open_checked(self.directory, follow=True)
        except (FileNotFoundError, CheckpointError):
            raise
        except OSError as exc:
            raise read_error(exc, f"checkpoint directory {self.directory}") from exc

    def open_checkpoint(self, step: int) -> CheckpointDir:
        """Open and check committed checkpoint ``step`` through the held checkpoint
        directory (never through a link); the caller closes it.

        Raises:
            CheckpointCorruptError: it does not exist.
            UntrustedCheckpointError: it (or the checkpoint directory) is not ours, is
                writable by others, or is a link.
            CheckpointReadError: it cannot be opened (I/O, permission, open files).
        """
        path = self.step_path(step)
        try:
            with self.open_root() as root:
                return root.open_dir(path.name)
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"checkpoint {path} does not exist") from exc
        except OSError as exc:
            raise read_error(exc, f"checkpoint {path}") from exc

    # ------------------------------------------------------------------ run binding
    def check_run(self, manifest: Manifest, path: Path, action: str = "load") -> None:
        """Refuse ``manifest`` if it names another run than this store's (a manifest
        naming no run, and a store without a run id, accept everything).

        Raises:
            ForeignRunError: naming both runs, the path and the fix.
        """
        check_run(manifest.run, self.run_id, path, self.directory, action)

    def check_directory_run(
        self, infos: builtins.list[CheckpointInfo], action: str = "load"
    ) -> None:
        """Refuse the whole directory if any listed checkpoint names another run.

        Raises:
            ForeignRunError: naming both runs.
        """
        for info in infos:
            if info.manifest is not None:
                self.check_run(info.manifest, info.path, action)

    # ------------------------------------------------------------------ leftovers
    def _entries(self) -> builtins.list[str]:
        try:
            with self.open_root() as root:
                return root.listdir()
        except FileNotFoundError:
            return []

    def _writer_dead(self, name: str, root: CheckpointDir | None = None) -> bool:
        def newest_mtime(entry: str) -> float:
            if root is not None:
                return root.newest_mtime(entry)
            with self.open_root() as held:  # only when asked: a writer on another host
                return held.newest_mtime(entry)

        return writer_dead(name, host=self._host, active=self._active, newest_mtime=newest_mtime)

    def leftovers(self) -> builtins.list[Path]:
        """Every ``.tmp-``, ``.replaced-`` and ``.trash-`` entry (live or dead writers)."""
        return sorted(
            self.directory / n for n in self._entries() if n.startswith(LEFTOVER_PREFIXES)
        )

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
        try:
            root = self.open_root()
        except FileNotFoundError:
            return []
        with root:
            return self._recover(root)

    def _recover(self, root: CheckpointDir) -> builtins.list[int]:
        recovered = []
        for name in sorted(root.listdir()):
            step = replaced_step(name)
            if step is None:
                continue
            final = step_dir_name(step)
            path = self.directory / name
            if final in root.listdir() or not self._writer_dead(name, root):
                continue
            try:
                with root.open_dir(name) as aside:  # never through a link
                    manifest = read_manifest(path, at=aside)  # a committed copy
                self.check_run(manifest, path, "recover")
                root.rename(name, final)
                root.sync()
            except (OSError, CheckpointError) as exc:
                log.warning("cannot recover checkpoint step %d from %s: %s", step, path, exc)
                continue
            log.warning(
                "recovered checkpoint %s from %s (a re-save of step %d died between its "
                "two renames)",
                self.directory / final,
                path,
                step,
            )
            recovered.append(step)
        return recovered

    def remove_stale(self) -> builtins.list[Path]:
        """Remove leftovers of dead writers (after :meth:`recover`); return those that stay.

        Run before writing, so that a save that died never keeps a full disk full. A
        leftover that is a link is unlinked (its target is never touched).
        """
        try:
            root = self.open_root()
        except FileNotFoundError:
            return []
        with root:
            self._recover(root)
            return self._remove_stale(root)

    def _remove_stale(self, root: CheckpointDir) -> builtins.list[Path]:
        remaining = []
        for name in sorted(n for n in root.listdir() if n.startswith(LEFTOVER_PREFIXES)):
            path = self.directory / name
            if not self._writer_dead(name, root):
                remaining.append(path)
                continue
            if not name.startswith(TRASH_PREFIX):
                log.warning("removing %s, left by an interrupted checkpoint save", path)
            try:
                root.remove_tree(name)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot remove %s: %s", path, exc)
                remaining.append(path)
        return remaining

    # ------------------------------------------------------------------ write
    def begin(self, step: int) -> Path:
        """Create and return a fresh private temporary directory for a save of ``step``.

        First creates the checkpoint directory (``0700``, each missing parent too) if
        needed, refuses a directory holding another run's checkpoints, recovers
        interrupted re-saves and removes leftovers of dead writers.

        Raises:
            UntrustedCheckpointError: the directory is not ours or writable by others.
            ForeignRunError: the directory holds another run's checkpoints.
            OSError: the directory cannot be created (the caller words the error).
        """
        make_private_dir(self.directory)
        with self.open_root() as root:
            self.check_directory_run(self._list(root), "save")
            self._recover(root)
            self._remove_stale(root)
            name = self._name(TMP_PREFIX, step)
            root.mkdir(name)  # 0700 exactly, whatever the umask
        self._active.add(name)
        return self.directory / name

    def commit(self, tmp: Path, manifest: Manifest) -> Path:
        """Write ``manifest`` into ``tmp``, make ``tmp`` durable, rename it to ``step_<N>``.

        The data files need not be fsynced yet: they, the manifest and ``tmp`` are fsynced
        together (concurrently) before the rename.

        Saving a step that exists moves the old copy aside first; :meth:`recover` restores
        it if the writer dies before the new copy is renamed in. Replacing a checkpoint
        that verifies with a different one is said: a WARNING naming both and a
        ``CheckpointRemoved`` event for the old copy (an identical one is replaced quietly).

        Raises:
            ForeignRunError: ``step_<N>`` is another run's.
            OSError: the manifest or the rename failed (``tmp`` is left for :meth:`discard`).
        """
        _faults.point("before_manifest")
        write_manifest(tmp, manifest, sync=False)
        sync_checkpoint(tmp, manifest)  # data files, manifest and tmp: all durable first
        _faults.point("before_commit")
        final = self.step_path(manifest.step)
        with self.open_root() as root:
            try:
                root.lstat(final.name)
            except FileNotFoundError:
                root.rename(tmp.name, final.name)
                root.sync()
            else:
                aside = self._name(REPLACED_PREFIX, manifest.step)
                self._say_replaced(root, final, manifest, self.directory / aside)
                root.rename(final.name, aside)
                _faults.point("between_renames")
                root.rename(tmp.name, final.name)
                root.sync()
                try:
                    root.remove_tree(aside)
                except OSError as exc:
                    log.warning("cannot remove the old copy %s: %s", self.directory / aside, exc)
        self._active.discard(tmp.name)
        _faults.point("after_commit")
        return final

    def _say_replaced(self, root: CheckpointDir, final: Path, new: Manifest, aside: Path) -> None:
        """Log (and emit) what a re-save of ``final`` replaces; refuse another run's."""
        try:
            with root.open_dir(final.name) as held:
                old = verify_checkpoint(final, deep=False, at=held)
        except CheckpointCorruptError as exc:
            log.warning("replacing damaged checkpoint %s (%s); old copy: %s", final, exc, aside)
            return
        except (OSError, CheckpointError) as exc:
            log.warning(
                "replacing checkpoint %s, which could not be checked (%s); old copy: %s",
                final,
                exc,
                aside,
            )
            return
        self.check_run(old, final, "replace a checkpoint")
        if old.files == new.files:
            log.info("checkpoint %s saved again with identical data; replacing it", final)
            return
        log.warning(
            "replacing checkpoint %s, which verifies (saved at %s by run %s, %d bytes), with "
            "a different state (%d bytes); the old copy (%s) is deleted",
            final,
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(old.created)),
            old.run or "(none)",
            old.total_bytes,
            new.total_bytes,
            aside,
        )
        events.emit(events.CheckpointRemoved(step=old.step, path=str(final)))

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
        """Committed checkpoints, oldest first (``manifest=None``: damaged, unreadable or
        a link; a link is never read through)."""
        try:
            root = self.open_root()
        except FileNotFoundError:
            return []
        with root:
            return self._list(root)

    def _list(self, root: CheckpointDir) -> builtins.list[CheckpointInfo]:
        infos: builtins.list[CheckpointInfo] = []
        for name in root.listdir():
            step = parse_step_dir(name)
            if step is None:
                continue
            path = self.directory / name
            try:
                mode = root.lstat(name).st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(mode):
                infos.append(CheckpointInfo(step, path, None, is_link=True))
                continue
            if not stat.S_ISDIR(mode):
                continue
            manifest: Manifest | None
            try:
                with root.open_dir(name) as held:
                    manifest = read_manifest(path, at=held)
            except (OSError, CheckpointError):
                manifest = None  # damaged or unreadable: a load says which
            infos.append(CheckpointInfo(step, path, manifest))
        infos.sort(key=lambda i: i.step)
        return infos

    def apply_retention(self, just_saved: int) -> None:
        """Delete old checkpoints; never one at or after ``just_saved`` (verified by
        construction, so the newest verified checkpoint is never touched).

        Each is first renamed to a ``.trash-`` name (atomic: it leaves the listing whole),
        then deleted through descriptors. Only checkpoints provably this run's are
        deleted: a manifest naming this run (both ``None`` outside a run). Kept, with a
        WARNING: damaged or unreadable ones, and, in a run, checkpoints naming no run
        (written before manifests named their run: remove them by hand); the WARNING
        names each once per store. A ``step_<N>``
        that is a link is unlinked, never followed (its target stays).

        Raises:
            ForeignRunError: the directory holds another run's checkpoints (nothing deleted).
        """
        if self.keep_last is None:
            return
        with self.open_root() as root:
            infos = self._list(root)
            self.check_directory_run(infos, "prune checkpoints")
            keep = {i.step for i in infos[-self.keep_last :]}
            keep.update(i.step for i in infos if i.step >= just_saved)
            if self.keep_every is not None:
                keep.update(i.step for i in infos if i.step % self.keep_every == 0)
            unproven: builtins.list[str] = []
            for info in infos:
                if info.step in keep:
                    continue
                if not info.is_link and (info.manifest is None or info.manifest.run != self.run_id):
                    unproven.append(info.path.name)
                    continue
                self._remove_checkpoint(root, info)
        if set(unproven) - self._kept_unproven:  # once per checkpoint, not every save
            self._kept_unproven.update(unproven)
            log.warning(
                "retention kept %s in %s: damaged, unreadable or naming no run (written "
                "before manifests named their run), so not provably run %s's; remove them by "
                "hand when no longer needed",
                ", ".join(unproven),
                self.directory,
                self.run_id,
            )

    def _remove_checkpoint(self, root: CheckpointDir, info: CheckpointInfo) -> None:
        name = info.path.name
        trash = self._name(TRASH_PREFIX, info.step)
        if info.is_link:
            log.info("retention: removing the link %s (its target is not touched)", info.path)
        else:
            log.info("retention: removing old checkpoint %s", info.path)
        try:
            root.rename(name, trash)
            root.sync()
            root.remove_tree(trash, after_first=lambda: _faults.point("mid_retention"))
        except OSError as exc:
            log.warning("retention could not remove %s: %s", info.path, exc)
        events.emit(events.CheckpointRemoved(step=info.step, path=str(info.path)))

    # ------------------------------------------------------------------ verify
    def verify(self, step: int, *, deep: bool = True, at: CheckpointDir | None = None) -> Manifest:
        """Verify committed checkpoint ``step`` (sizes; with ``deep`` every CRC32 too).

        The checkpoint directory, ``step_<N>``, the manifest and every data file are
        opened through held descriptors and must be owned by this user and not writable
        by others (nothing else is ever read); the manifest must not name another run.

        Args:
            step: the step.
            deep: also check every CRC32.
            at: ``step_<N>`` already held (:meth:`open_checkpoint`): verify that one.

        Raises:
            CheckpointCorruptError: missing, incomplete or damaged (naming what).
            UntrustedCheckpointError: a path is not ours, writable by others, or a link.
            ForeignRunError: it is another run's checkpoint.
            CheckpointReadError: an I/O or memory error (not damage: it stays).
        """
        path = self.step_path(step)
        if at is None:
            with self.open_checkpoint(step) as held:
                return self.verify(step, deep=deep, at=held)
        manifest = verify_checkpoint(path, deep=deep, at=at)
        self.check_run(manifest, path)
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
            ForeignRunError: the directory holds another run's checkpoints.
            CheckpointReadError: an I/O or memory error (nothing is skipped for it).
        """
        self.recover()
        self.warn_incomplete()
        infos = self.list_checkpoints()
        self.check_directory_run(infos)
        for info in reversed(infos):
            try:
                manifest = self.verify(info.step, deep=deep)
            except CheckpointCorruptError as exc:
                self.report_damaged(info, exc)
                continue
            return CheckpointInfo(info.step, info.path, manifest)
        return None
