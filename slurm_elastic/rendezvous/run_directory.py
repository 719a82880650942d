"""Run directories and eras: which rendezvous state a starting agent may join.

Layout under the rendezvous root (the ``--rdzv-endpoint`` directory)::

    <root>/                     0700, owned by the user (checked)
      <run_id>/                 one per run id: two runs may share a root
        era.<k>/              one per *era*: a state that agents may join
          meta                  JSON: cohort (who may join), created_by, Slurm job
          head, seg.<k>/state.<n>  the rendezvous state (see backend.py)
          hb/<node>             heartbeat counters (see heartbeat.py)
          intents/<node>        join intents (see join_intents.py)
          keys/<incarnation>    one empty file per job allocation that took part
          store                 JSON: the current round's worker-store address

**Requeue safety.** Two identities come from Slurm (:class:`Incarnation`):

* ``cohort`` says who may *join an open era*: for a plain (multi-node) job it is
  ``<job_id>.<restart_count>``, so a requeued or resubmitted job never joins the state
  of an earlier run (whose members are dead); for an array task it is the array job id,
  so a requeued task rejoins the running tasks of its array (the run is not reset).
* ``key`` identifies this allocation: ``<SLURM_JOB_ID>.<restart_count>``.

A starting agent takes the newest era when it is open with its cohort (an open
era of *another* cohort that is still live, judged by its heartbeats over one
liveness window, makes it fail with :class:`RunIdInUseError`: two jobs never share one);
when the era is *closed* it raises :class:`RendezvousClosedError` if its own key took
part in that era (a late agent of a finished job), and otherwise opens a new era:
a closed run never poisons a requeue. Eras are created by ``rename`` of a fully built
directory (exclusive: one creator wins, the others use the winner's); one agent claims
the creation (``.create.<k>``) and the others wait for it rather than build copies.
Eras older than the previous two are deleted by the creator of a new one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousStateError,
)

from slurm_elastic.errors import RendezvousSetupError, RunIdInUseError
from slurm_elastic.rendezvous.backend import FileRendezvousBackend, init_state_dir
from slurm_elastic.rendezvous.filesystem import RendezvousDir
from slurm_elastic.rendezvous.state import RowCache, decode_state

__all__ = ["Era", "Incarnation", "RunDirectory", "RunIdInUseError", "safe_component"]

log = logging.getLogger(__name__)

_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,120}$")
_SLURM_KEY = re.compile(r"^(\d+)\.(\d+)$")


def safe_component(value: str) -> str:
    """Return ``value`` as a safe single path component (unsafe ones get a hash suffix)."""
    if _SAFE.match(value) and value not in (".", ".."):
        return value
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", value).lstrip(".")[:80] or "x"
    digest = hashlib.sha256(value.encode()).hexdigest()[:10]
    return f"{cleaned}-{digest}"


_ERA = "era."
_LEGACY_ERA = "epoch."  # the name of an era before 2026-12-03

#: How long an agent waits for the agent that claimed an era's creation to create it.
_CREATE_WAIT_S = 2.0


@dataclass(frozen=True)
class Incarnation:
    """Who this agent is, for requeue safety.

    Attributes:
        cohort: agents with equal cohort may join each other's open era.
        key: this allocation (job id + restart count); closes are tied to it.
    """

    cohort: str
    key: str
    job: dict[str, Any] | None = field(default=None, compare=False)
    #: Whether the key can recur (a later agent of the same allocation): only then is
    #: it worth recording. A derived local key is unique to one process.
    recorded: bool = field(default=True, compare=False)

    @classmethod
    def from_environ(
        cls,
        environ: Mapping[str, str],
        *,
        cohort: str | None = None,
        key: str | None = None,
    ) -> Incarnation:
        """Derive the incarnation from ``SLURM_*`` variables (explicit values win).

        Outside Slurm the cohort is ``"local"`` (agents of one run id join each
        other) and the key is unique per process (a closed run never blocks a new one).
        """
        from slurm_elastic.slurm.env import SlurmEnv

        env = SlurmEnv.from_environ(environ)
        job: dict[str, Any] | None = None
        recorded = True
        if env.in_slurm:
            own = f"{env.job_id}.{env.restart_count}"
            derived_cohort = f"array-{env.array_job_id}" if env.array_job_id else f"job-{own}"
            derived_key = own
            job = {
                "id": str(env.array_job_id or env.job_id),
                "job_id": str(env.job_id),
                "restart": int(env.restart_count),
            }
        else:
            derived_cohort = "local"
            derived_key = f"local-{uuid.uuid4().hex}"
            recorded = key is not None
        return cls(cohort or derived_cohort, key or derived_key, job, recorded)


class Era:
    """One era directory (held open): the state backend and its side files.

    Args:
        directory: the checked, open era directory.
        number: the era number.
    """

    def __init__(self, directory: RendezvousDir, number: int) -> None:
        self.dir = directory
        self.number = number
        self._hb: RendezvousDir | None = None
        self._keys: RendezvousDir | None = None
        self._intents: RendezvousDir | None = None
        self._rows = RowCache()  # one agent's backends share the rows they checked

    @property
    def path(self) -> Path:
        """The era directory's path (for messages)."""
        return self.dir.path

    @property
    def hb_dir(self) -> Path:
        return self.path / "hb"

    @property
    def keys_dir(self) -> Path:
        return self.path / "keys"

    @property
    def hb(self) -> RendezvousDir:
        """The heartbeat directory (opened and checked on first use)."""
        if self._hb is None:
            self._hb = self.dir.subdir("hb", create=True)
        return self._hb

    @property
    def intents(self) -> RendezvousDir:
        """The directory of join intents (opened and checked on first use)."""
        if self._intents is None:
            self._intents = self.dir.subdir("intents", create=True)
        return self._intents

    @property
    def keys(self) -> RendezvousDir:
        """The directory of incarnation keys (opened and checked on first use)."""
        if self._keys is None:
            self._keys = self.dir.subdir("keys", create=True)
        return self._keys

    def backend(self) -> FileRendezvousBackend:
        """Return a new backend object on this era (one per thread)."""
        return FileRendezvousBackend(self.dir, rows=self._rows)

    def meta(self) -> dict[str, Any] | None:
        """Return the era's metadata, or None when missing or malformed."""
        try:
            raw = self.dir.read("meta", limit=1 << 16)
            if raw is None:
                return None
            meta = json.loads(raw)
        except (OSError, ValueError) as exc:
            log.warning("ignoring malformed rendezvous era metadata in %s: %s", self.path, exc)
            return None
        if not isinstance(meta, dict) or not isinstance(meta.get("cohort"), str):
            log.warning("ignoring malformed rendezvous era metadata in %s", self.path)
            return None
        return meta

    def register_key(self, key: str) -> None:
        """Record that incarnation ``key`` takes part in this era.

        The ``keys`` directory stays bounded over churn: a key is one file per job
        allocation (all its agents share it, so re-registering is a no-op), and a Slurm
        key ``<job_id>.<restart>`` replaces the keys of the same job's earlier restarts
        (that allocation is gone: no agent of it can start again).
        """
        name = safe_component(key)
        self.keys.touch(name)
        mine = _SLURM_KEY.match(name)
        if mine is None:
            return
        for other in self.keys.listdir():
            theirs = _SLURM_KEY.match(other)
            if (
                theirs is not None
                and theirs.group(1) == mine.group(1)
                and int(theirs.group(2)) < int(mine.group(2))
            ):
                self.keys.remove(other)

    def has_key(self, key: str) -> bool:
        """Whether incarnation ``key`` took part in this era."""
        return self.keys.exists(safe_component(key))

    def publish_store(
        self, round_: int, node: str, addr: str, port: int, members: str = ""
    ) -> None:
        """Publish the worker-store address of round ``round_`` (atomic replace).

        ``members``: rank 0's digest of the round's members and ranks.
        """
        record = {"round": round_, "node": node, "addr": addr, "port": port, "members": members}
        self.dir.replace("store", json.dumps(record).encode())

    def read_store(self) -> dict[str, Any] | None:
        """Return the published worker-store record, or None (missing/malformed).

        Raises:
            RendezvousStateError: the era directory was deleted.
        """
        try:
            raw = self.dir.read("store", limit=1 << 16)
            if raw is None:
                if self.dir.deleted():
                    raise RendezvousStateError(
                        f"the rendezvous directory {str(self.path)!r} was deleted while in "
                        "use; restart the job and keep the directory while it runs"
                    )
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

    def activity(self) -> tuple[Any, ...]:
        """A snapshot that changes while any agent is active in this era.

        The newest state generation (the compare-and-set token) and every heartbeat counter: a live member beats
        every heartbeat interval, so two snapshots one liveness window apart differ
        if (and only if, barring a stall that long) a member is alive.
        """
        try:
            gen = self.backend().latest_generation()
        except RendezvousStateError:
            gen = -1
        beats = []
        try:
            for name in sorted(self.hb.listdir()):
                if not name.startswith(".tmp"):
                    beats.append((name, self.hb.read(name, limit=64)))
        except OSError:
            pass
        return gen, tuple(beats)


class RunDirectory:
    """The directory of one run id under a private rendezvous root.

    Args:
        root: the rendezvous root (created ``0700`` if missing, refused if unsafe).
        run_id: the run id (any string; mapped to a safe directory name).
        anchor: the ancestor from which every directory must be the user's (see
            :meth:`RendezvousDir.open_tree`; default: derived from ownership).
        liveness_window_s: how long a foreign era is watched for activity before
            it is judged dead (the heartbeat window of the run).

    Raises:
        RendezvousSetupError: the root or run directory is unsafe or unusable.
    """

    def __init__(
        self,
        root: Path,
        run_id: str,
        *,
        anchor: Path | None = None,
        liveness_window_s: float = 5.0,
    ) -> None:
        self.root = Path(root)
        self._root_dir = RendezvousDir.open_tree(self.root, anchor=anchor)
        self.run_id = run_id
        self.dir = self._root_dir.subdir(safe_component(run_id))
        self.path = self.dir.path
        self._liveness_window_s = liveness_window_s

    def _eras(self) -> list[int]:
        numbers = []
        names = self.dir.listdir()
        for name in names:
            if name.startswith(_ERA):
                try:
                    numbers.append(int(name[len(_ERA) :]))
                except ValueError:
                    continue
        legacy = sorted(n for n in names if n.startswith(_LEGACY_ERA))
        if legacy:
            raise RendezvousSetupError(
                f"rendezvous run directory {str(self.path)!r} holds the state of an earlier "
                f"slurm_elastic version ({legacy[-1]}: before 2026-12-03 an era was named "
                "'epoch'); agents of two versions must not share one run. Give this job "
                "another --rdzv-id (run id), or remove that directory once no agent of the "
                "old run is left"
            )
        return sorted(numbers)

    def era(self, number: int) -> Era:
        """Open era ``number`` (checked).

        Raises:
            RendezvousSetupError: it is missing or unsafe.
        """
        return Era(self.dir.subdir(f"era.{number}", create=False), number)

    def _create(self, number: int, incarnation: Incarnation) -> None:
        """Create era ``number`` unless another agent does (then wait for theirs).

        One agent claims the creation (one exclusive ``mkdir``); the others wait for the
        era to appear instead of each building a copy to throw away (an array of
        1,024 tasks starting at once made about as many copies, and the run directory
        they all list grew with them). A claimant that died or stalls is overtaken
        after :data:`_CREATE_WAIT_S`: then the ``rename`` decides, as before.
        """
        claim = f".create.{number}"
        if self.dir.claim(claim):
            if self.dir.exists(f"era.{number}"):  # created since this agent listed
                self.dir.rmdir(claim)
                return
        else:
            deadline = time.monotonic() + _CREATE_WAIT_S
            delay = 0.002
            while time.monotonic() < deadline:
                time.sleep(delay)
                if self.dir.exists(f"era.{number}"):
                    return
                delay = min(2 * delay, 0.1)
            log.info("rendezvous run %r: era %d was claimed but not created in %.0f s; "
                     "creating it", self.run_id, number, _CREATE_WAIT_S)  # fmt: skip
        try:
            tmp_name = self.dir.tmp_name(f"era.{number}")
            tmp = self.dir.subdir(tmp_name, create=True)
            try:
                tmp.subdir("hb").close()
                tmp.subdir("keys").close()
                tmp.subdir("intents").close()
                init_state_dir(tmp)
                meta = {
                    "cohort": incarnation.cohort,
                    "created_by": incarnation.key,
                    "job": incarnation.job,
                    "liveness_window_s": self._liveness_window_s,
                }
                tmp.replace("meta", json.dumps(meta).encode())
            finally:
                tmp.close()
            try:
                self.dir.rename(tmp_name, f"era.{number}")
            except OSError:  # another agent created it first: use theirs
                self.dir.rmtree(tmp_name)
                return
        finally:
            self.dir.rmdir(claim)  # ours, or a dead claimant's: settled either way
        log.info(
            "rendezvous run %r: opened era %d for cohort %s",
            self.run_id,
            number,
            incarnation.cohort,
        )
        for old in self._eras():
            if old < number - 2:
                self.dir.rmtree(f"era.{old}")

    def _foreign_is_live(self, era: Era, meta: dict[str, Any], me: Incarnation) -> bool:
        """Whether the open era of another cohort still has live agents."""
        theirs = meta.get("job")
        if isinstance(theirs, dict) and me.job is not None:
            same_job = theirs.get("id") == me.job.get("id") and theirs.get("id") is not None
            if same_job and theirs.get("restart", 0) < me.job.get("restart", 0):
                return False  # our own job before its requeue: it is dead
        window = meta.get("liveness_window_s", self._liveness_window_s)
        if not isinstance(window, (int, float)) or not 0 < window < 3600:
            window = self._liveness_window_s
        before = era.activity()
        deadline = time.monotonic() + float(window) * 1.2
        while time.monotonic() < deadline:
            time.sleep(min(0.25, float(window) / 4))
            if era.activity() != before:
                return True
        return False

    def select_era(self, incarnation: Incarnation) -> Era:
        """Return the era this agent must join, creating a new one when needed.

        Raises:
            RendezvousClosedError: the newest era was closed by this incarnation.
            RunIdInUseError: the newest era belongs to another job that is live.
            RendezvousSetupError: an era directory is unsafe.
            RendezvousStateError: no era could be settled on.
        """
        for _ in range(32):
            numbers = self._eras()
            if not numbers:
                self._create(1, incarnation)
                continue
            era = self.era(numbers[-1])
            meta = era.meta()
            if meta is None:
                self._create(era.number + 1, incarnation)
                continue
            try:
                current = era.backend().get_state()
                closed = current is not None and decode_state(current[0]).closed
            except RendezvousStateError as exc:  # a malformed newest record: start afresh
                log.warning("rendezvous state in %s unusable (%s); opening a new era",
                            era.path, exc)  # fmt: skip
                self._create(era.number + 1, incarnation)
                continue
            if closed:
                if era.has_key(incarnation.key):
                    raise RendezvousClosedError(
                        f"the rendezvous of run {self.run_id!r} was closed by this job "
                        f"(incarnation {incarnation.key}); it has finished. Use a new run id "
                        "or requeue the job to start again. If this job never ran before, "
                        "Slurm gave it the id of an earlier job that used this state_dir "
                        "(a controller whose state was reset restarts job ids; clusters "
                        "sharing a filesystem overlap them): give it its own run_id or "
                        "state_dir, or its checkpoints are that job's"
                    )
                self._create(era.number + 1, incarnation)
                continue
            if meta["cohort"] != incarnation.cohort:
                if self._foreign_is_live(era, meta, incarnation):
                    raise RunIdInUseError(
                        f"rendezvous run id {self.run_id!r} is in use by another live job "
                        f"({_describe(meta)}; era {str(era.path)!r}), not by this one "
                        f"({incarnation.cohort}). Two jobs must not share a run id: "
                        "give this job another --rdzv-id (run_id), or stop the other job"
                    )
                log.info(
                    "rendezvous run %r: era %d belongs to %s (no longer active), not %s; "
                    "opening a new one",
                    self.run_id,
                    era.number,
                    meta["cohort"],
                    incarnation.cohort,
                )
                self._create(era.number + 1, incarnation)
                continue
            if incarnation.recorded:
                era.register_key(incarnation.key)
            return era
        raise RendezvousStateError(
            f"could not settle on a rendezvous era in {str(self.path)!r}; check that no "
            "other process keeps creating eras there"
        )


def _describe(meta: dict[str, Any]) -> str:
    job = meta.get("job")
    if isinstance(job, dict) and job.get("id") is not None:
        return f"Slurm job {job.get('id')}, cohort {meta['cohort']}"
    return f"cohort {meta['cohort']}"
