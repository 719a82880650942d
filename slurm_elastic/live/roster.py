"""The in-place messages of the node channel: registrations and assignments (torch-free).

Four messages of the node channel (:mod:`slurm_elastic.channel`, which owns the
directory, lists every message and clears them), each a small JSON file written
atomically (temporary file + ``rename``):

* ``worker.<local_rank>``: written by a worker that can re-form its process group in
  place (:func:`register_worker`): ``{"pid": ..., "live": true}``. The agent re-forms in
  place only when every local worker registered with its current pid; a worker that
  leaves because its node has no place in the new round removes it
  (:func:`unregister_worker`). Before that, while it joins its first group and takes its
  state, the worker is registered as starting (``"live": false``): it has trained no
  step, so a restart loses nothing and the agent need not wait for it to save.
* ``assign.<local_rank>``: written by the agent after a rendezvous round it ran while
  the workers kept training (:func:`write_assignment`): the worker's new rank, world
  size, and the round's store address (:class:`Assignment`). A worker reads it at step
  boundaries through an :class:`AssignmentWatch` (one ``stat`` per poll).
* ``closed.<local_rank>``: written by a worker whose session finished and closed
  (:func:`mark_closed`): ``{"pid": ...}``. Only its interpreter's exit remains, which
  torch's gloo teardown aborts now and then; the agent counts such a worker as finished.
* ``restart.<local_rank>``: written for a warm-started worker whose script made its
  process group without registering first (:func:`watch_for_restart_path`): a script
  without ``ElasticSession`` (plain ``init_process_group``), which never registers. The
  agent then stops waiting for it as for a worker still starting (it restarts it for a
  newcomer after the notice, as the restart path does) for as long as it runs.

The round a worker was started in reaches it through ``$SLURM_ELASTIC_ROUND``; an
assignment for the same or an older round is stale and ignored. ``$SLURM_ELASTIC_IN_PLACE``
= ``0`` switches the in-place path off for agent and workers alike (the restart path).

The files are read as hostile input (any process of the user can write the directory):
through :func:`slurm_elastic.channel.read_node_file` (no FIFO, directory, device or link
is opened for reading, nothing larger than :data:`MAX_FILE_BYTES` is read), parsed as
strict JSON (``NaN``/``Infinity`` refused), and every number checked for type (an integer,
not a bool or a float) and range. A file that fails is ignored with a warning naming it
(rate-limited, see :func:`slurm_elastic.channel.warn_ignored`), as if it were absent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slurm_elastic import envvars
from slurm_elastic.channel import NodeChannel, read_node_file, warn_ignored, write_node_file

__all__ = [
    "IN_PLACE_ENV",
    "MAX_FILE_BYTES",
    "ROUND_ENV",
    "Assignment",
    "AssignmentWatch",
    "in_place_enabled",
    "mark_restart_path",
    "read_assignment",
    "register_worker",
    "registered_workers",
    "restart_path_pid",
    "unregister_worker",
    "watch_for_restart_path",
    "write_assignment",
]

ROUND_ENV = envvars.ROUND_ENV
IN_PLACE_ENV = envvars.IN_PLACE_ENV

log = logging.getLogger(__name__)

#: A channel file larger than this is refused unread (ours are under 300 bytes).
MAX_FILE_BYTES = 64 * 1024
# Ranges of the numbers in channel files. Far above any real job, low enough that no
# reader can be made to build a list of world_size keys that does not fit in memory.
_MAX_RANKS = 1 << 20
_MAX_ROUND = (1 << 31) - 1
_MAX_PID = (1 << 31) - 1  # pid_t
_MAX_PORT = 65535
_MAX_ADDR_CHARS = 255
_SUFFIX = re.compile(r"[0-9]{1,7}")  # a local rank (ASCII digits only)


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
        after_loss: the agent formed this round because its previous round lost a
            member (left or evicted), not for a newcomer alone. A worker stalled in a
            collective may then abort it (:mod:`slurm_elastic.live.abort`).
        loss_round: the newest round the agent formed after a loss (this one when
            ``after_loss``; ``-1``: none). Carried into later rounds, so a worker still
            in an older round learns of a loss it never saw an assignment of (a
            newcomer's round overwrote it: the stall guard looks only when overdue).
    """

    round: int
    rank: int
    world_size: int
    local_rank: int
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    after_loss: bool = False
    loss_round: int = -1

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Assignment:
        """Parse a dict written by :meth:`as_dict`.

        Every number must be an ``int`` (not a bool, a float or a string) in its range:
        ``0 <= rank < world_size <= 2**20``, local and group ranks likewise, the round in
        ``[0, 2**31)``, the port in ``[0, 65535]``; the address a string of at most 255
        characters; ``after_loss``, if present, a bool; ``loss_round``, if present, in
        ``[-1, round]``.

        Raises:
            ValueError: a field is missing, has the wrong type or is out of range.
        """
        try:
            result = cls(
                round=_int_field(data, "round", 0, _MAX_ROUND),
                rank=_int_field(data, "rank", 0, _MAX_RANKS - 1),
                world_size=_int_field(data, "world_size", 1, _MAX_RANKS),
                local_rank=_int_field(data, "local_rank", 0, _MAX_RANKS - 1),
                group_rank=_int_field(data, "group_rank", 0, _MAX_RANKS - 1),
                group_world_size=_int_field(data, "group_world_size", 0, _MAX_RANKS),
                master_addr=_str_field(data, "master_addr", _MAX_ADDR_CHARS),
                master_port=_int_field(data, "master_port", 0, _MAX_PORT),
                after_loss=_bool_field(data, "after_loss", default=False),
                loss_round=_int_field({"loss_round": -1, **data}, "loss_round", -1, _MAX_ROUND),
            )
            if result.loss_round > result.round:
                raise ValueError(f"loss_round={result.loss_round} is after round={result.round}")
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed assignment {_short(dict(data))}: {exc}") from exc
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


def _short(value: object, limit: int = 80) -> str:
    """``repr`` cut to ``limit`` characters (values come from hostile files)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _int_field(data: Mapping[str, Any], name: str, low: int, high: int) -> int:
    value = data[name]
    # type(...) is int: a bool is an int to isinstance, and int() would accept floats
    # (and raise OverflowError on Infinity) and strings.
    if type(value) is not int:
        raise ValueError(f"{name}={_short(value)} is not an integer")
    if not low <= value <= high:
        raise ValueError(f"{name}={_short(value)} outside [{low}, {high}]")
    return value


def _bool_field(data: Mapping[str, Any], name: str, *, default: bool) -> bool:
    value = data.get(name, default)
    if type(value) is not bool:
        raise ValueError(f"{name}={_short(value)} is not true or false")
    return value


def _str_field(data: Mapping[str, Any], name: str, max_chars: int) -> str:
    value = data[name]
    if not isinstance(value, str) or not 0 < len(value) <= max_chars:
        raise ValueError(f"{name}={_short(value)} is not a string of 1 to {max_chars} characters")
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    write_node_file(path, json.dumps(dict(data), allow_nan=False).encode())


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; ``None`` if absent or refused (with a warning)."""
    found = read_node_file(path, MAX_FILE_BYTES, log)
    if found is None:
        return None
    try:
        # parse_constant: Python's json accepts NaN and Infinity, which are not JSON.
        data = json.loads(found.data.decode("utf-8"), parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        warn_ignored(log, path, f"not strict JSON ({_short(str(exc))})")
        return None
    if not isinstance(data, dict):
        warn_ignored(log, path, "not a JSON object")
        return None
    return data


def register_worker(channel: NodeChannel, local_rank: int, pid: int, *, live: bool = True) -> None:
    """Announce that worker ``local_rank`` (process ``pid``) can re-form in place, or
    (``live=False``) that it is starting: no step trained yet, nothing of its to save."""
    _write_json(channel.registration(local_rank), {"pid": pid, "live": live})


def unregister_worker(channel: NodeChannel, local_rank: int) -> None:
    """Withdraw worker ``local_rank``'s registration (it is leaving: the agent must start
    a new worker, not re-form this one, if its node gets a place in a later round)."""
    with contextlib.suppress(FileNotFoundError):
        channel.registration(local_rank).unlink()


def registered_workers(channel: NodeChannel, *, live: bool | None = True) -> dict[int, int]:
    """Return ``{local_rank: pid}`` of the workers registered as live (or, with
    ``live=False``, as starting; with ``live=None``, either).

    A registration that is not ``{"pid": <int in [1, 2**31)>, "live": <bool>}`` in a
    regular file named ``worker.<digits>`` is ignored with a warning.
    """
    found: dict[int, int] = {}
    try:
        paths = channel.registrations()
    except OSError as exc:
        warn_ignored(log, channel.directory, f"cannot list it ({exc.strerror or exc})")
        return found
    for path in paths:
        suffix = path.name.split(".", 1)[1]
        if not _SUFFIX.fullmatch(suffix):
            warn_ignored(log, path, "not named worker.<local rank>")
            continue
        data = _read_json(path)
        if data is None:
            continue
        try:
            pid = _int_field(data, "pid", 1, _MAX_PID)
            if not isinstance(data.get("live"), bool):
                raise ValueError(f"live={_short(data.get('live'))}, not true or false")
        except (KeyError, ValueError) as exc:
            warn_ignored(log, path, f"malformed registration: {exc}")
            continue
        if live is None or data["live"] is live:
            found[int(suffix)] = pid
    return found


def mark_closed(channel: NodeChannel, local_rank: int, pid: int) -> None:
    """Worker ``local_rank`` (process ``pid``) finished: its session closed and left its
    process group; only its interpreter's exit remains (:func:`closed_pid`)."""
    _write_json(channel.closed(local_rank), {"pid": pid})


def _pid_mark(path: Path, what: str) -> int | None:
    """The pid in the mark at ``path`` (``{"pid": ...}``); ``None`` if absent or malformed
    (with a warning naming ``what``)."""
    if not path.exists():
        return None
    data = _read_json(path)
    try:
        return None if data is None else _int_field(data, "pid", 1, _MAX_PID)
    except (KeyError, ValueError) as exc:
        warn_ignored(log, path, f"malformed {what}: {exc}")
        return None


def closed_pid(channel: NodeChannel, local_rank: int) -> int | None:
    """The pid in worker ``local_rank``'s closed mark; ``None`` if absent or malformed
    (with a warning)."""
    return _pid_mark(channel.closed(local_rank), "closed mark")


def mark_restart_path(channel: NodeChannel, local_rank: int, pid: int) -> None:
    """Worker ``local_rank`` (process ``pid``) made its process group without registering:
    its script takes the restart path (:func:`watch_for_restart_path`)."""
    _write_json(channel.restart_path(local_rank), {"pid": pid})


def restart_path_pid(channel: NodeChannel, local_rank: int) -> int | None:
    """The pid in worker ``local_rank``'s restart-path mark; ``None`` if absent or
    malformed (with a warning)."""
    return _pid_mark(channel.restart_path(local_rank), "restart-path mark")


def watch_for_restart_path(
    channel: NodeChannel,
    local_rank: int,
    pid: int,
    group_exists: Callable[[], bool],
    *,
    poll_s: float = 0.25,
) -> threading.Thread:
    """Start a daemon thread that marks this worker as taking the restart path once its
    script has a process group and no registration (:func:`mark_restart_path`).

    ``ElasticSession`` in place registers (as starting) *before* it makes its group, so a
    group with no registration of this pid came from the script itself: plain
    ``init_process_group`` (or ``ElasticSession`` with the in-place path off). The
    thread ends at the first of: a registration seen, the mark written, the channel gone.

    Args:
        group_exists: whether the default process group exists now (the caller passes
            ``torch.distributed.is_initialized``; this module is torch-free).
    """

    def registered() -> bool:
        return (
            channel.registration(local_rank).exists()
            and registered_workers(channel, live=None).get(local_rank) == pid
        )

    def run() -> None:
        try:
            while channel.directory.is_dir():
                if group_exists():  # first the group, then the registration: see above
                    if not registered():
                        mark_restart_path(channel, local_rank, pid)
                    return
                if registered():
                    return
                time.sleep(poll_s)
        except OSError as exc:  # the channel went (the agent left): nobody to tell
            log.debug("restart-path watch of local rank %d ended: %s", local_rank, exc)

    thread = threading.Thread(target=run, name="slurm-elastic-restart-path", daemon=True)
    thread.start()
    return thread


def write_assignment(channel: NodeChannel, assignment: Assignment) -> None:
    """Hand ``assignment`` to the worker of its ``local_rank``."""
    _write_json(channel.assignment(assignment.local_rank), assignment.as_dict())


def read_assignment(channel: NodeChannel, local_rank: int) -> Assignment | None:
    """The last assignment written for ``local_rank`` (``None``: none or unreadable)."""
    path = channel.assignment(local_rank)
    data = _read_json(path)
    if data is None:
        return None
    try:
        found = Assignment.from_dict(data)
    except ValueError as exc:
        warn_ignored(log, path, str(exc))
        return None
    if found.local_rank != local_rank:
        warn_ignored(log, path, f"names local_rank {found.local_rank}, not {local_rank}")
        return None
    return found


class AssignmentWatch:
    """Cheap polling for a new assignment of one worker.

    Args:
        channel: the node channel.
        local_rank: the worker's local rank.
        current_round: assignments for this round or older are stale.
        min_interval_s: at most one ``stat`` per this interval.
    """

    def __init__(
        self,
        channel: NodeChannel,
        local_rank: int,
        current_round: int,
        min_interval_s: float = 0.02,
    ) -> None:
        self._path = channel.assignment(local_rank)
        self._channel = channel
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
                # lstat: a link's own times decide when to look; the read refuses it.
                st = os.lstat(self._path)
            except FileNotFoundError:
                st = None
            except OSError as exc:  # ENOTDIR, EACCES: as if there were no assignment
                warn_ignored(log, self._path, f"cannot stat it ({exc.strerror or exc})")
                st = None
            key = None if st is None else (st.st_mtime_ns, st.st_ino)
            if key is not None and key != self._seen:
                self._seen = key
                found = read_assignment(self._channel, self._local_rank)
                if found is not None:
                    self._latest = found
        latest = self._latest
        if latest is not None and latest.round > self.current_round:
            return latest
        return None
