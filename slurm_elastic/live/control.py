"""The node's control channel between an agent and its workers (torch-free).

A directory on the node (``$SLURM_ELASTIC_CONTROL_DIR``, private to the agent's user)
holds small JSON files, each written atomically (temporary file + ``rename``):

* ``worker.<local_rank>``: written by a worker that can re-form its process group in
  place (:func:`register_worker`): ``{"pid": ..., "live": true}``. The agent re-forms in
  place only when every local worker registered with its current pid; a worker that
  leaves because its node has no place in the new round removes it
  (:func:`unregister_worker`).
* ``assign.<local_rank>``: written by the agent after a rendezvous round it ran while
  the workers kept training (:func:`write_assignment`): the worker's new rank, world
  size, and the round's store address (:class:`Assignment`). A worker reads it at step
  boundaries through an :class:`AssignmentWatch` (one ``stat`` per poll).

The round a worker was started in reaches it through ``$SLURM_ELASTIC_ROUND``; an
assignment for the same or an older round is stale and ignored. ``$SLURM_ELASTIC_IN_PLACE``
= ``0`` switches the in-place path off for agent and workers alike (the restart path).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slurm_elastic import envvars

__all__ = [
    "CONTROL_DIR_ENV",
    "IN_PLACE_ENV",
    "ROUND_ENV",
    "Assignment",
    "AssignmentWatch",
    "clear",
    "in_place_enabled",
    "read_assignment",
    "register_worker",
    "registered_workers",
    "unregister_worker",
    "write_assignment",
]

CONTROL_DIR_ENV = envvars.CONTROL_DIR_ENV
ROUND_ENV = envvars.ROUND_ENV
IN_PLACE_ENV = envvars.IN_PLACE_ENV


def in_place_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether membership changes may happen in place (``$SLURM_ELASTIC_IN_PLACE`` != 0)."""
    env = os.environ if environ is None else environ
    return env.get(IN_PLACE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class Assignment:
    """One worker's place in a rendezvous round.

    Attributes:
        round: the rendezvous round (the same number on every node).
        rank: the worker's global rank.
        world_size: the number of workers in the round.
        local_rank: the worker's rank on its node (names the file).
        group_rank: the node's rank.
        group_world_size: the number of nodes.
        master_addr: host of the round's store.
        master_port: port of the round's store.
    """

    round: int
    rank: int
    world_size: int
    local_rank: int
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Assignment:
        """Parse a dict written by :meth:`as_dict`.

        Raises:
            ValueError: a field is missing or has the wrong type.
        """
        try:
            result = cls(
                round=int(data["round"]),
                rank=int(data["rank"]),
                world_size=int(data["world_size"]),
                local_rank=int(data["local_rank"]),
                group_rank=int(data["group_rank"]),
                group_world_size=int(data["group_world_size"]),
                master_addr=str(data["master_addr"]),
                master_port=int(data["master_port"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed assignment {dict(data)!r}: {exc}") from exc
        if not 0 <= result.rank < result.world_size:
            raise ValueError(f"assignment rank {result.rank} outside the world: {result}")
        return result

    def as_dict(self) -> dict[str, Any]:
        """The JSON-able form."""
        return asdict(self)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Assignment | None:
        """The assignment a worker was started with (torch's variables), if complete."""
        env = os.environ if environ is None else environ
        try:
            return cls(
                round=int(env.get(ROUND_ENV, "0")),
                rank=int(env["RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                local_rank=int(env.get("LOCAL_RANK", "0")),
                group_rank=int(env.get("GROUP_RANK", "0")),
                group_world_size=int(env.get("GROUP_WORLD_SIZE", "1")),
                master_addr=env["MASTER_ADDR"],
                master_port=int(env["MASTER_PORT"]),
            )
        except (KeyError, ValueError):
            return None


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps(dict(data)).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def register_worker(directory: str | os.PathLike[str], local_rank: int, pid: int) -> None:
    """Announce that worker ``local_rank`` (process ``pid``) can re-form in place."""
    _write_json(Path(directory) / f"worker.{local_rank}", {"pid": pid, "live": True})


def unregister_worker(directory: str | os.PathLike[str], local_rank: int) -> None:
    """Withdraw worker ``local_rank``'s registration (it is leaving: the agent must start
    a new worker, not re-form this one, if its node gets a place in a later round)."""
    with contextlib.suppress(FileNotFoundError):
        (Path(directory) / f"worker.{local_rank}").unlink()


def registered_workers(directory: str | os.PathLike[str]) -> dict[int, int]:
    """Return ``{local_rank: pid}`` of the workers that registered."""
    found: dict[int, int] = {}
    with contextlib.suppress(FileNotFoundError):
        for path in Path(directory).glob("worker.*"):
            data = _read_json(path)
            suffix = path.name.split(".", 1)[1]
            if data and data.get("live") is True and suffix.isdigit():
                with contextlib.suppress(TypeError, ValueError):
                    found[int(suffix)] = int(data["pid"])
    return found


def write_assignment(directory: str | os.PathLike[str], assignment: Assignment) -> None:
    """Hand ``assignment`` to the worker of its ``local_rank``."""
    _write_json(Path(directory) / f"assign.{assignment.local_rank}", assignment.as_dict())


def read_assignment(directory: str | os.PathLike[str], local_rank: int) -> Assignment | None:
    """The last assignment written for ``local_rank`` (``None``: none or unreadable)."""
    data = _read_json(Path(directory) / f"assign.{local_rank}")
    if data is None:
        return None
    try:
        return Assignment.from_dict(data)
    except ValueError:
        return None


def clear(directory: str | os.PathLike[str]) -> None:
    """Remove every registration and assignment (before workers are (re)started)."""
    with contextlib.suppress(FileNotFoundError):
        for path in Path(directory).iterdir():
            if path.name.startswith(("worker.", "assign.", ".")):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()


class AssignmentWatch:
    """Cheap polling for a new assignment of one worker.

    Args:
        directory: the control directory.
        local_rank: the worker's local rank.
        current_round: assignments for this round or older are stale.
        min_interval_s: at most one ``stat`` per this interval.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        local_rank: int,
        current_round: int,
        min_interval_s: float = 0.02,
    ) -> None:
        self._path = Path(directory) / f"assign.{local_rank}"
        self._directory = directory
        self._local_rank = local_rank
        self.current_round = current_round
        self._min_interval_s = min_interval_s
        self._checked = -float("inf")
        self._seen: tuple[int, int] | None = None
        self._latest: Assignment | None = None

    def poll(self, force: bool = False) -> Assignment | None:
        """The newest assignment for a round after ``current_round``, else ``None``."""
        now = time.monotonic()
        if force or now - self._checked >= self._min_interval_s:
            self._checked = now
            try:
                st = os.stat(self._path)
            except FileNotFoundError:
                st = None
            key = None if st is None else (st.st_mtime_ns, st.st_ino)
            if key is not None and key != self._seen:
                self._seen = key
                found = read_assignment(self._directory, self._local_rank)
                if found is not None:
                    self._latest = found
        latest = self._latest
        if latest is not None and latest.round > self.current_round:
            return latest
        return None
