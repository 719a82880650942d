"""Run directories and epochs: which rendezvous state a starting agent may join.

Layout under the rendezvous root (the ``--rdzv-endpoint`` directory)::

    <root>/                     0700, owned by the user (checked)
      <run_id>/                 one per run id: two runs may share a root
        epoch.<k>/              one per *epoch*: a state that agents may join
          meta                  JSON: generation (who may join), created_by
          head, state.<n>       the rendezvous state (see backend.py)
          hb/<node>             heartbeat counters (see heartbeat.py)
          keys/<incarnation>    one empty file per job incarnation that took part
          store                 JSON: the current round's worker-store address

**Requeue safety.** Two identities come from Slurm (:class:`Incarnation`):

* ``generation`` says who may *join an open epoch*: for a plain (multi-node) job it is
  ``<job_id>.<restart_count>``, so a requeued or resubmitted job never joins the state
  of an earlier run (whose members are dead); for an array task it is the array job id,
  so a requeued task rejoins the running tasks of its array (the run is not reset).
* ``key`` identifies this allocation: ``<SLURM_JOB_ID>.<restart_count>``.

A starting agent takes the newest epoch when it is empty, or open with its generation;
when the epoch is *closed* it raises :class:`RendezvousClosedError` if its own key took
part in that epoch (a late agent of a finished job), and otherwise opens a new epoch:
a closed run never poisons a requeue. Epochs are created by ``rename`` of a fully built
directory (exclusive: one creator wins, the others use the winner's). Epochs older than
the previous two are deleted by the creator of a new one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousStateError,
)

from slurm_elastic.rendezvous import filesystem as fs
from slurm_elastic.rendezvous.backend import FileRendezvousBackend, decode_state

__all__ = ["Epoch", "Incarnation", "RunDirectory", "safe_component"]

log = logging.getLogger(__name__)

_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,120}$")


def safe_component(value: str) -> str:
    """Return ``value`` as a safe single path component (unsafe ones get a hash suffix)."""
    if _SAFE.match(value) and value not in (".", ".."):
        return value
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", value).lstrip(".")[:80] or "x"
    digest = hashlib.sha256(value.encode()).hexdigest()[:10]
    return f"{cleaned}-{digest}"


@dataclass(frozen=True)
class Incarnation:
    """Who this agent is, for requeue safety.

    Attributes:
        generation: agents with equal generation may join each other's open epoch.
        key: this allocation (job id + restart count); closes are tied to it.
    """

    generation: str
    key: str

    @classmethod
    def from_environ(
        cls,
        environ: Mapping[str, str],
        *,
        generation: str | None = None,
        key: str | None = None,
    ) -> Incarnation:
        """Derive the incarnation from ``SLURM_*`` variables (explicit values win).

        Outside Slurm the generation is ``"local"`` (agents of one run id join each
        other) and the key is unique per process (a closed run never blocks a new one).
        """
        from slurm_elastic.slurm.env import SlurmEnv

        env = SlurmEnv.from_environ(environ)
        if env.in_slurm:
            own = f"{env.job_id}.{env.restart_count}"
            derived_gen = f"array-{env.array_job_id}" if env.array_job_id else f"job-{own}"
            derived_key = own
        else:
            derived_gen = "local"
            derived_key = f"local-{uuid.uuid4().hex}"
        return cls(generation or derived_gen, key or derived_key)


class Epoch:
    """One epoch directory: the state backend and its side files."""

    def __init__(self, path: Path, number: int) -> None:
        self.path = path
        self.number = number
        self.hb_dir = path / "hb"
        self.keys_dir = path / "keys"

    def backend(self) -> FileRendezvousBackend:
        """Return a new backend object on this epoch (one per thread)."""
        return FileRendezvousBackend(self.path)

    def meta(self) -> dict[str, Any] | None:
        """Return the epoch's metadata, or None when missing or malformed."""
        try:
            raw = fs.read_small(self.path / "meta", limit=1 << 16)
            if raw is None:
                return None
            meta = json.loads(raw)
        except (OSError, ValueError) as exc:
            log.warning("ignoring malformed rendezvous epoch metadata in %s: %s", self.path, exc)
            return None
        if not isinstance(meta, dict) or not isinstance(meta.get("generation"), str):
            log.warning("ignoring malformed rendezvous epoch metadata in %s", self.path)
            return None
        return meta

    def register_key(self, key: str) -> None:
        """Record that incarnation ``key`` takes part in this epoch."""
        path = self.keys_dir / safe_component(key)
        fs.FS_OPS.add("open")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        os.close(fd)

    def has_key(self, key: str) -> bool:
        """Whether incarnation ``key`` took part in this epoch."""
        fs.FS_OPS.add("stat")
        return os.path.lexists(self.keys_dir / safe_component(key))

    def publish_store(self, round_: int, node: str, addr: str, port: int) -> None:
        """Publish the worker-store address of round ``round_`` (atomic replace)."""
        record = {"round": round_, "node": node, "addr": addr, "port": port}
        fs.replace_file(self.path, "store", json.dumps(record).encode())

    def read_store(self) -> dict[str, Any] | None:
        """Return the published worker-store record, or None (missing/malformed)."""
        try:
            raw = fs.read_small(self.path / "store", limit=1 << 16)
            if raw is None:
                return None
            rec = json.loads(raw)
        except (OSError, ValueError) as exc:
            log.warning("ignoring malformed worker-store record in %s: %s", self.path, exc)
            return None
        if (
            not isinstance(rec, dict)
            or not isinstance(rec.get("round"), int)
            or not isinstance(rec.get("addr"), str)
            or not isinstance(rec.get("port"), int)
            or not isinstance(rec.get("node"), str)
        ):
            log.warning("ignoring malformed worker-store record in %s", self.path)
            return None
        return rec


class RunDirectory:
    """The directory of one run id under a private rendezvous root.

    Args:
        root: the rendezvous root (created ``0700`` if missing, refused if unsafe).
        run_id: the run id (any string; mapped to a safe directory name).

    Raises:
        RendezvousSetupError: the root or run directory is unsafe or unusable.
    """

    def __init__(self, root: Path, run_id: str) -> None:
        self.root = fs.ensure_private_dir(Path(root))
        self.run_id = run_id
        self.path = fs.ensure_private_dir(self.root / safe_component(run_id))

    def _epochs(self) -> list[int]:
        numbers = []
        for name in fs.listdir(self.path):
            if name.startswith("epoch."):
                try:
                    numbers.append(int(name[6:]))
                except ValueError:
                    continue
        return sorted(numbers)

    def epoch(self, number: int) -> Epoch:
        """Return epoch ``number`` (not checked for existence)."""
        return Epoch(self.path / f"epoch.{number}", number)

    def _create(self, number: int, incarnation: Incarnation) -> None:
        tmp = fs.tmp_name(self.path, f"epoch.{number}")
        fs.FS_OPS.add("mkdir", 3)
        os.mkdir(tmp, 0o700)
        os.mkdir(tmp / "hb", 0o700)
        os.mkdir(tmp / "keys", 0o700)
        meta = {"generation": incarnation.generation, "created_by": incarnation.key}
        fs.replace_file(tmp, "meta", json.dumps(meta).encode())
        try:
            fs.FS_OPS.add("rename")
            os.rename(tmp, self.path / f"epoch.{number}")
        except OSError:  # another agent created it first: use theirs
            shutil.rmtree(tmp, ignore_errors=True)
            return
        log.info(
            "rendezvous run %r: opened epoch %d for generation %s",
            self.run_id,
            number,
            incarnation.generation,
        )
        for old in self._epochs():
            if old < number - 2:
                shutil.rmtree(self.path / f"epoch.{old}", ignore_errors=True)

    def select_epoch(self, incarnation: Incarnation) -> Epoch:
        """Return the epoch this agent must join, creating a new one when needed.

        Raises:
            RendezvousClosedError: the newest epoch was closed by this incarnation.
            RendezvousSetupError: an epoch directory is unsafe.
            RendezvousStateError: no epoch could be settled on.
        """
        for _ in range(32):
            numbers = self._epochs()
            if not numbers:
                self._create(1, incarnation)
                continue
            epoch = self.epoch(numbers[-1])
            fs.ensure_private_dir(epoch.path, create=False)
            meta = epoch.meta()
            if meta is None:
                self._create(epoch.number + 1, incarnation)
                continue
            current = epoch.backend().get_state()
            closed = False
            if current is not None:
                try:
                    closed = decode_state(current[0]).closed
                except Exception as exc:  # a malformed newest record: start afresh
                    log.warning("rendezvous state in %s unreadable (%s)", epoch.path, exc)
                    self._create(epoch.number + 1, incarnation)
                    continue
            if closed:
                if epoch.has_key(incarnation.key):
                    raise RendezvousClosedError(
                        f"the rendezvous of run {self.run_id!r} was closed by this job "
                        f"(incarnation {incarnation.key}); it has finished. Use a new run id "
                        "or requeue the job to start again"
                    )
                self._create(epoch.number + 1, incarnation)
                continue
            if current is not None and meta["generation"] != incarnation.generation:
                log.info(
                    "rendezvous run %r: epoch %d belongs to %s, not %s; not joining it",
                    self.run_id,
                    epoch.number,
                    meta["generation"],
                    incarnation.generation,
                )
                self._create(epoch.number + 1, incarnation)
                continue
            fs.ensure_private_dir(epoch.hb_dir)
            fs.ensure_private_dir(epoch.keys_dir)
            epoch.register_key(incarnation.key)
            return epoch
        raise RendezvousStateError(
            f"could not settle on a rendezvous epoch in {str(self.path)!r}; check that no "
            "other process keeps creating epochs there"
        )
