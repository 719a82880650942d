"""Typed structured events written by agents, rendezvous, checkpoints and training scripts.

An event is one JSON object per line, appended to ``<events_dir>/<host>.<pid>.jsonl``
(one file per writer, so writers on different nodes never interleave partial lines on
a shared filesystem). ``slurm-elastic status``, ``logs`` and ``timeline`` merge the files
by ``time`` (:func:`read_events`).

Every kind of event is one frozen dataclass here (a subclass of :class:`Event`, registered
under its ``kind`` string). Emitters construct them; readers get them back::

    events.emit(events.CheckpointSaved(step=100, path="/ckpt/step_100", bytes=1 << 20))
    for e in events.read_events(directory):
        if isinstance(e, events.CheckpointSaved): ...

Record (on disk): ``v`` (the schema version, :data:`SCHEMA_VERSION`), ``kind``, ``time``
(Unix seconds, float), ``host``, ``pid``, ``run_id``, then the fields of the kind.

Compatibility rules:

* a reader keeps what it does not know: a record of an unknown kind (a newer version's)
  becomes an :class:`UnknownEvent` holding all its fields; fields a known kind does not
  declare are kept in ``extra``; a declared field missing from a record gets its default;
* a torn last line (a writer killed mid-write) is skipped; so is a malformed line (not
  JSON, not an object, a field not of its declared type), with a warning naming the file
  and the line: the files are input (:func:`read_events` says how they are read);
* new fields are added with defaults, never renamed; a change that breaks this bumps
  :data:`SCHEMA_VERSION`.

Events also read like the record mapping (``e["step"]``, ``e.get("step")``) so that code
written against the untyped records keeps working.

The sink is chosen by the ``SLURM_ELASTIC_EVENTS_DIR`` environment variable, which the
agent sets for its workers; with no sink configured :func:`emit` does nothing, so library
code may call it unconditionally. Event files are created 0600 and opened without
following a symbolic link (``O_NOFOLLOW``): the directory lives on a shared filesystem.

The run index (:func:`record_run`, :func:`find_run`) maps a run id (the Slurm job id) to its
state, events and checkpoint directories, so ``slurm-elastic status JOB`` finds a run after
Slurm forgot the job.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import socket
import stat
import time
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

from slurm_elastic.envvars import EVENTS_DIR_ENV, RUN_ID_ENV
from slurm_elastic.errors import UnsafeDirectoryError
from slurm_elastic.privatefs import ensure_private_dir

__all__ = [
    "EVENTS_DIR_ENV",
    "EVENT_TYPES",
    "SCHEMA_VERSION",
    "AgentExit",
    "AgentGaveUp",
    "AgentHang",
    "AgentRequeued",
    "AgentRestart",
    "AgentSignal",
    "AgentStart",
    "AgentTerminated",
    "AgentWindow",
    "CheckpointFailed",
    "CheckpointLoaded",
    "CheckpointRemoved",
    "CheckpointSaved",
    "CheckpointSkipped",
    "Event",
    "LiveCollectiveAborted",
    "RendezvousComplete",
    "RendezvousEvicted",
    "RendezvousLeft",
    "RunIndexEntry",
    "TrainDone",
    "TrainPreempted",
    "TrainProgress",
    "TrainStart",
    "UnknownEvent",
    "WorkersStarted",
    "WorkersSucceeded",
    "emit",
    "event_from_record",
    "find_run",
    "read_events",
    "record_run",
    "run_index_dir",
]

#: The version of the record layout; readers accept every version (see the module doc).
SCHEMA_VERSION = 1

log = logging.getLogger(__name__)

#: The fields every record carries (not part of a kind's own fields).
_BASE_FIELDS = ("v", "kind", "time", "host", "pid", "run_id")


def _host() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _run_id() -> str | None:
    return os.environ.get(RUN_ID_ENV)


@dataclass(frozen=True, kw_only=True)
class Event:
    """The fields of every event; subclasses add the fields of one kind.

    Attributes:
        time: Unix seconds when it happened (the writer's clock).
        host: the node (``SLURMD_NODENAME``, else the host name).
        pid: the writing process.
        run_id: the run (``SLURM_ELASTIC_RUN_ID``), ``None`` outside a run.
        v: the schema version the record was written with.
        extra: fields of the record this version does not declare (kept, never dropped).
    """

    kind: ClassVar[str] = ""

    time: float = field(default_factory=time.time)
    host: str = field(default_factory=_host)
    pid: int = field(default_factory=os.getpid)
    run_id: str | None = field(default_factory=_run_id)
    v: int = SCHEMA_VERSION
    extra: Mapping[str, Any] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        """The kind's own fields and the extra ones (no base fields)."""
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in _BASE_FIELDS and f.name != "extra"
        }
        return {**self.extra, **out}

    def to_record(self) -> dict[str, Any]:
        """The JSON-able record written to disk."""
        return {
            "v": self.v,
            "kind": self.kind,
            "time": self.time,
            "host": self.host,
            "pid": self.pid,
            "run_id": self.run_id,
            **self.fields(),
        }

    # Read access like the record mapping (compatibility with the untyped records).
    def __getitem__(self, key: str) -> Any:
        record = self.to_record()
        return record[key]

    def get(self, key: str, default: Any = None) -> Any:
        """``record.get(key, default)``."""
        return self.to_record().get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self.to_record()


@dataclass(frozen=True, kw_only=True)
class UnknownEvent(Event):
    """A record of a kind this version does not know (e.g. written by a newer one).

    ``kind`` is the record's kind; all its other fields are in ``extra``.
    """

    kind: str = ""  # type: ignore[misc]  # an instance field here, a ClassVar elsewhere


EVENT_TYPES: dict[str, type[Event]] = {}


def _register(cls: type[Event]) -> type[Event]:
    EVENT_TYPES[cls.kind] = cls
    return cls


# -- agent ---------------------------------------------------------------------------------


@_register
@dataclass(frozen=True, kw_only=True)
class AgentStart(Event):
    """An agent started (once per agent process; a requeued task starts a new one)."""

    kind: ClassVar[str] = "agent.start"
    config: Mapping[str, Any] = field(default_factory=dict)
    requeue_count: int = 0
    job: str | None = None  # the Slurm job or array task (``12_3``), None locally


@_register
@dataclass(frozen=True, kw_only=True)
class WorkersStarted(Event):
    """A round completed and this node's workers (re)started."""

    kind: ClassVar[str] = "agent.workers_started"
    group_rank: int | None = None
    group_world_size: int = 0  # nodes in the round
    world_size: int = 0  # workers in the round
    restart_count: int = 0
    #: global rank -> the worker's log file ("" when workers write to the agent's output)
    logs: Mapping[str, str] = field(default_factory=dict)


@_register
@dataclass(frozen=True, kw_only=True)
class AgentRestart(Event):
    """The agent restarts its workers in a new round."""

    kind: ClassVar[str] = "agent.restart"
    reason: str = ""
    remaining_restarts: int = 0


@_register
@dataclass(frozen=True, kw_only=True)
class AgentHang(Event):
    """The hang watchdog fired: no progress report for ``progress_age_s`` seconds."""

    kind: ClassVar[str] = "agent.hang"
    progress_age_s: float = 0.0


@_register
@dataclass(frozen=True, kw_only=True)
class WorkersSucceeded(Event):
    """This node's workers finished successfully."""

    kind: ClassVar[str] = "agent.workers_succeeded"


@_register
@dataclass(frozen=True, kw_only=True)
class AgentGaveUp(Event):
    """Workers failed with no restarts left."""

    kind: ClassVar[str] = "agent.gave_up"
    max_restarts: int = 0


@_register
@dataclass(frozen=True, kw_only=True)
class AgentSignal(Event):
    """The agent got a signal (``notice``: the preemption notice signal or SIGTERM)."""

    kind: ClassVar[str] = "agent.signal"
    signal: str = ""
    notice: bool = False
    in_place: bool = False


@_register
@dataclass(frozen=True, kw_only=True)
class AgentExit(Event):
    """The agent exits with ``code`` (an ``ExitCode`` name)."""

    kind: ClassVar[str] = "agent.exit"
    code: str = ""
    error: str | None = None


@_register
@dataclass(frozen=True, kw_only=True)
class AgentTerminated(Event):
    """The agent was stopped by signals that were not a preemption notice."""

    kind: ClassVar[str] = "agent.terminated"
    signals: list[str] = field(default_factory=list)


@_register
@dataclass(frozen=True, kw_only=True)
class AgentRequeued(Event):
    """The agent requeued its own Slurm task (``job``) after a preemption."""

    kind: ClassVar[str] = "agent.requeued"
    job: str = ""
    requeue_count: int = 0


@_register
@dataclass(frozen=True, kw_only=True)
class AgentWindow(Event):
    """The warning this task gets before SIGKILL, as the agent read it at start
    (:mod:`slurm_elastic.slurm.window`); ``None``: not known. ``save_s``/``fits``: the
    longest recent durable save of the run and whether it fits every window."""

    kind: ClassVar[str] = "agent.window"
    signal_lead_s: float | None = None
    grace_time_s: float | None = None
    kill_wait_s: float | None = None
    partition: str | None = None
    preemptable: bool = True
    shutdown_timeout_s: float = 0.0
    save_s: float | None = None
    fits: bool | None = None


# -- rendezvous ----------------------------------------------------------------------------


@_register
@dataclass(frozen=True, kw_only=True)
class RendezvousComplete(Event):
    """A rendezvous round completed; this node got ``rank`` of ``world_size`` nodes."""

    kind: ClassVar[str] = "rendezvous.complete"
    round: int = 0
    epoch: int = 0
    rank: int = 0
    world_size: int = 0
    node: str = ""
    store: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class RendezvousEvicted(Event):
    """Nodes whose heartbeats stopped were evicted."""

    kind: ClassVar[str] = "rendezvous.evicted"
    nodes: list[str] = field(default_factory=list)


@_register
@dataclass(frozen=True, kw_only=True)
class RendezvousLeft(Event):
    """A node left the rendezvous gracefully."""

    kind: ClassVar[str] = "rendezvous.left"
    node: str = ""


# -- checkpoint ----------------------------------------------------------------------------


@_register
@dataclass(frozen=True, kw_only=True)
class CheckpointSaved(Event):
    """A checkpoint was committed (``format``: ``replicated`` or ``sharded``)."""

    kind: ClassVar[str] = "checkpoint.saved"
    step: int = 0
    path: str = ""
    bytes: int = 0
    seconds: float = 0.0
    stall_seconds: float | None = None
    format: str = "replicated"


@_register
@dataclass(frozen=True, kw_only=True)
class CheckpointFailed(Event):
    """A checkpoint save failed; nothing was committed."""

    kind: ClassVar[str] = "checkpoint.failed"
    step: int = 0
    path: str = ""
    error: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class CheckpointRemoved(Event):
    """Retention removed an old checkpoint."""

    kind: ClassVar[str] = "checkpoint.removed"
    step: int = 0
    path: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class CheckpointSkipped(Event):
    """A damaged checkpoint was skipped when loading."""

    kind: ClassVar[str] = "checkpoint.skipped"
    step: int = 0
    path: str = ""
    error: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class CheckpointLoaded(Event):
    """Training resumed from a checkpoint."""

    kind: ClassVar[str] = "checkpoint.loaded"
    step: int = 0
    path: str = ""
    seconds: float | None = None
    format: str = "replicated"


# -- training (emitted by the training script) ---------------------------------------------


@_register
@dataclass(frozen=True, kw_only=True)
class TrainStart(Event):
    """A worker starts (or resumes) training at ``step`` in a world of ``world_size``."""

    kind: ClassVar[str] = "train.start"
    step: int = 0
    world_size: int = 0
    rank: int = 0
    total_steps: int | None = None  # when known: status and submit --wait show a bar


@_register
@dataclass(frozen=True, kw_only=True)
class TrainProgress(Event):
    """Periodic progress (rank 0 only is enough); the source of throughput."""

    kind: ClassVar[str] = "train.progress"
    step: int = 0
    rank: int = 0
    total_steps: int | None = None
    samples: int | None = None  # samples trained so far (global), when known


@_register
@dataclass(frozen=True, kw_only=True)
class TrainPreempted(Event):
    """A worker saved and left after a preemption notice."""

    kind: ClassVar[str] = "train.preempted"
    step: int = 0
    rank: int = 0


@_register
@dataclass(frozen=True, kw_only=True)
class TrainDone(Event):
    """A worker finished training."""

    kind: ClassVar[str] = "train.done"
    step: int = 0
    rank: int = 0


# -- in-place membership changes (slurm_elastic.live) -------------------------------------


@_register
@dataclass(frozen=True, kw_only=True)
class AgentLeaveInPlace(Event):
    """The agent leaves the rendezvous while its workers train on until the switch."""

    kind: ClassVar[str] = "agent.leave_in_place"


@_register
@dataclass(frozen=True, kw_only=True)
class AgentReformedInPlace(Event):
    """The agent handed its live workers the assignment of a new round."""

    kind: ClassVar[str] = "agent.reformed_in_place"
    round: int = 0
    group_rank: int = 0
    group_world_size: int = 0
    world_size: int = 0


@_register
@dataclass(frozen=True, kw_only=True)
class LiveStart(Event):
    """A worker under ``ElasticLoop`` starts (or resumes) training."""

    kind: ClassVar[str] = "live.start"
    rank: int = 0
    world_size: int = 0
    step: int = 0
    in_place: bool = False
    resumed_from: str | None = None


@_register
@dataclass(frozen=True, kw_only=True)
class LiveReformed(Event):
    """A worker switched to a new world in place (``cause``: graceful or failure)."""

    kind: ClassVar[str] = "live.reformed"
    cause: str = ""
    round: int = 0
    rank: int = 0
    world_size: int = 0
    old_world_size: int | None = None
    step: int = 0
    redone_steps: int = 0
    switch_s: float = 0.0


@_register
@dataclass(frozen=True, kw_only=True)
class LivePeerFailure(Event):
    """A collective failed because a peer was lost; the worker rolls back to its commit."""

    kind: ClassVar[str] = "live.peer_failure"
    step: int = 0
    error: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class LiveCollectiveAborted(Event):
    """A worker ended its blocked collective: no step for ``stalled_s`` and its round
    lost a member (a silent loss); it then rolls back and re-forms in ``new_round``."""

    kind: ClassVar[str] = "live.collective_aborted"
    round: int = 0
    new_round: int = 0
    stalled_s: float = 0.0
    connections: int = 0


@_register
@dataclass(frozen=True, kw_only=True)
class LiveLeft(Event):
    """A worker left the loop (``after``: why it stopped)."""

    kind: ClassVar[str] = "live.left"
    step: int = 0
    after: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class LiveDone(Event):
    """A worker under ``ElasticLoop`` finished training."""

    kind: ClassVar[str] = "live.done"
    step: int = 0
    rank: int = 0


# -- construction from records -------------------------------------------------------------

#: Integers a reader accepts (steps, sizes, pids): anything larger is damage, not a count.
_INT_BOUND = 1 << 63
#: Times a reader accepts (Unix seconds): far beyond any run, yet differences stay finite.
_TIME_BOUND = 1e12


_FIELD_TYPES: dict[type[Event], dict[str, tuple[Any, str]]] = {}


def _field_types(cls: type[Event]) -> dict[str, tuple[Any, str]]:
    """Declared field -> (its type, as written in the class) for the reader's type check."""
    if cls not in _FIELD_TYPES:
        hints = typing.get_type_hints(cls)
        _FIELD_TYPES[cls] = {f.name: (hints[f.name], str(f.type)) for f in dataclasses.fields(cls)}
    return _FIELD_TYPES[cls]


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a JSON-decoded ``value`` has the declared type ``hint``.

    ``bool`` is no ``int`` here (JSON ``true`` is no step), integers are bounded and
    floats finite, so what a reader accepts cannot overflow the arithmetic of a summary.
    """
    if hint is Any:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if hint is int:
        return isinstance(value, int) and -_INT_BOUND < value < _INT_BOUND
    if hint is float:
        return isinstance(value, (int, float)) and abs(value) < _INT_BOUND
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if origin in (dict, Mapping):
        return isinstance(value, dict) and all(
            _conforms(k, args[0]) and _conforms(v, args[1]) for k, v in value.items()
        )
    return False  # a type this check does not know: refuse rather than guess


def _type_errors(cls: type[Event], fields: Mapping[str, Any]) -> str | None:
    """What is wrongly typed among ``fields`` (declared fields of ``cls``), else None."""
    declared = _field_types(cls)
    for name, value in fields.items():
        if name in declared and not _conforms(value, declared[name][0]):
            shown = repr(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            return f"field {name!r} is {shown}, not of type {declared[name][1]}"
    return None


def event_from_record(record: Mapping[str, Any], *, strict: bool = False) -> Event:
    """The typed event of one record; unknown kinds and fields are kept (module doc).

    Args:
        record: one decoded record.
        strict: also refuse a record whose fields do not have their declared types (what
            :func:`read_events` does: a file is input, a wrongly typed step would break
            every reader downstream); base fields are checked for unknown kinds too.

    Raises:
        ValueError: the record has no ``kind`` string or no numeric ``time`` (strict: a
            finite one), or (strict) a field is not of its declared type.
    """
    kind = record.get("kind")
    when = record.get("time")
    if not isinstance(kind, str) or not isinstance(when, (int, float)) or isinstance(when, bool):
        raise ValueError(f"not an event record (kind={kind!r}, time={when!r})")
    if strict:
        if not abs(when) <= _TIME_BOUND:  # NaN fails this too
            raise ValueError(f"time {when!r} is no Unix time")
        present = {k: record[k] for k in ("host", "pid", "run_id", "v") if k in record}
        problem = _type_errors(Event, present)
        if problem is not None:
            raise ValueError(problem)
    base: dict[str, Any] = {
        "time": float(when),
        "host": str(record.get("host", "")),
        "pid": record.get("pid") if isinstance(record.get("pid"), int) else 0,
        "run_id": record.get("run_id"),
        "v": record.get("v") if isinstance(record.get("v"), int) else 0,
    }
    rest = {k: v for k, v in record.items() if k not in _BASE_FIELDS}
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        return UnknownEvent(kind=kind, extra=rest, **base)
    declared = {f.name for f in dataclasses.fields(cls)} - set(_BASE_FIELDS) - {"extra"}
    known = {k: v for k, v in rest.items() if k in declared}
    extra = {k: v for k, v in rest.items() if k not in declared}
    if strict:
        problem = _type_errors(cls, known)
        if problem is not None:
            raise ValueError(problem)
    try:
        return cls(**base, **known, extra=extra)
    except TypeError:  # pragma: no cover - all declared fields have defaults
        return UnknownEvent(kind=kind, extra=rest, **base)


def _legacy(kind: str, fields: Mapping[str, Any]) -> Event:
    """``emit("kind", **fields)``: the typed event of a kind given by name."""
    fields = dict(fields)
    if "kind" in fields:  # the old sharded checkpoint events said kind="sharded"
        fields["format"] = fields.pop("kind")
    record = {"kind": kind, "time": time.time(), "host": _host(), "pid": os.getpid()}
    record["run_id"] = _run_id()
    record["v"] = SCHEMA_VERSION
    return event_from_record({**fields, **record})


# -- writing -------------------------------------------------------------------------------

_OPEN_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)


def emit(event: Event | str, /, **fields: Any) -> None:
    """Append one event to this process's event file, if a sink is configured.

    ``event`` is a typed :class:`Event`; ``emit("kind", **fields)`` (for training
    scripts) builds the typed event of that kind from the fields.

    Never raises: an event that cannot be written is logged at DEBUG and dropped, because
    observability must not take training down.
    """
    directory = os.environ.get(EVENTS_DIR_ENV)
    if not directory:
        return
    try:
        typed = _legacy(event, fields) if isinstance(event, str) else event
        line = json.dumps(typed.to_record(), default=str) + "\n"
        path = Path(directory) / f"{typed.host}.{typed.pid}.jsonl"
        ensure_private_dir(path.parent)
        # O_APPEND: each write of one line lands whole at the end of our own file.
        # O_NOFOLLOW: a symlink planted at our file name on the shared FS is refused.
        fd = os.open(path, _OPEN_FLAGS, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except (OSError, TypeError, ValueError, UnsafeDirectoryError) as exc:
        name = event if isinstance(event, str) else event.kind
        log.debug("dropping event %s: %s", name, exc)


# -- reading -------------------------------------------------------------------------------

#: A record is well under 1 KiB; a longer line is damage, skipped without being held.
MAX_RECORD_BYTES = 1 << 20
#: Of a bigger events file only the first and the last half of this many bytes are read
#: (the run's start and its latest state): memory stays bounded whatever the file.
MAX_EVENTS_FILE_BYTES = 64 << 20
#: Warnings per file and read; the rest of a damaged file is counted, not listed.
_MAX_WARNINGS = 5
_CHUNK = 1 << 16
# O_NONBLOCK: opening a FIFO returns at once (fstat then refuses it) instead of waiting
# for a writer forever.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_warned: set[tuple[str, str]] = set()  # (file, what): said once per process (--watch)


def _warn(path: Path, message: str) -> None:
    key = (str(path), message)
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", message)


def _open_events_file(path: Path) -> BinaryIO | None:
    """``path`` opened for reading: a regular file, not reached through a link; else None."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            _warn(
                path,
                f"skipping events file {str(path)!r}: a symbolic link (event files "
                "are never followed; remove it from the run's events directory)",
            )
        else:
            log.debug("skipping events file %s: %s", path, exc)
        return None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        _warn(
            path,
            f"skipping events file {str(path)!r}: not a regular file "
            f"({stat.filemode(mode)}); remove it from the run's events directory",
        )
        return None
    return os.fdopen(fd, "rb")


def _skip_line(fh: BinaryIO, budget: int) -> int:
    """Read (and drop) up to the end of the current line; return the bytes read."""
    used = 0
    while used < budget:
        piece = fh.readline(min(_CHUNK, budget - used))
        if not piece:
            break
        used += len(piece)
        if piece.endswith(b"\n"):
            break
    return used


def _file_lines(path: Path, fh: BinaryIO) -> Iterator[tuple[str, bytes | None]]:
    """(where, line) of each line of an events file; ``None`` for an overlong line.

    ``where`` is ``line N`` (``the line at byte N`` after a skipped middle). Only the
    bytes there when the file was opened are read (a live writer's next lines are the
    next read's). A last line without its newline (a writer mid-write) is not yielded.
    """
    size = os.fstat(fh.fileno()).st_size
    half = MAX_EVENTS_FILE_BYTES // 2
    pos, number, counting = 0, 0, True
    while pos < size:
        if size > MAX_EVENTS_FILE_BYTES and half <= pos < size - half:
            start = size - half  # the middle: skipped, said once
            _warn(
                path,
                f"{str(path)!r} is {size} bytes: read its first and last "
                f"{half >> 20} MiB only (bytes {pos}-{start} skipped)",
            )
            fh.seek(start - 1)
            mid_line = fh.read(1) != b"\n"
            pos = start + (_skip_line(fh, size - start) if mid_line else 0)
            counting = False
            continue
        where = f"line {number + 1}" if counting else f"the line at byte {pos}"
        number += 1
        line = fh.readline(min(MAX_RECORD_BYTES + 1, size - pos))
        if not line:
            return
        pos += len(line)
        if not line.endswith(b"\n"):
            if len(line) <= MAX_RECORD_BYTES:
                return  # torn last line
            pos += _skip_line(fh, size - pos)
            yield where, None
            continue
        yield where, line


def _parse(line: bytes) -> dict[str, Any]:
    """One line's JSON object. NaN and Infinity are no JSON (nor is a number of 5000
    digits or an array nested 100000 deep: ValueError, RecursionError).

    Raises:
        ValueError: not a JSON object.
    """

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not a number in JSON")

    try:
        record = json.loads(line.decode("utf-8", errors="replace"), parse_constant=refuse)
    except RecursionError:
        raise ValueError("nested too deep") from None
    except ValueError as exc:
        raise ValueError(f"not JSON ({str(exc)[:80]})") from None
    if not isinstance(record, dict):
        raise ValueError(f"not a JSON object but {type(record).__name__}")
    return record


def _file_events(path: Path) -> Iterator[Event]:
    """The well-formed events of one file; the rest skipped with a warning."""
    fh = _open_events_file(path)
    if fh is None:
        return
    bad = 0
    with fh:
        for where, line in _file_lines(path, fh):
            if line is not None and not line.strip():
                continue
            try:
                if line is None:
                    raise ValueError(f"longer than {MAX_RECORD_BYTES} bytes")
                event = event_from_record(_parse(line), strict=True)
            except ValueError as exc:
                bad += 1
                if bad <= _MAX_WARNINGS:
                    _warn(path, f"skipping {where} of {str(path)!r}: {exc}")
                continue
            yield event
    if bad > _MAX_WARNINGS:
        _warn(path, f"skipped {bad - _MAX_WARNINGS} more malformed lines of {str(path)!r}")


def read_events(directory: str | os.PathLike[str]) -> Iterator[Event]:
    """Yield every well-formed event under ``directory``, ordered by time.

    The files are input, possibly damaged or planted by someone else: they are read line
    by line (a record of at most :data:`MAX_RECORD_BYTES`, at most
    :data:`MAX_EVENTS_FILE_BYTES` of a file), never through a link, never a FIFO or
    device. A malformed line (not JSON, no event, a field not of its declared type) is
    skipped with a warning naming the file and the line; a torn last line silently.
    Unknown kinds come back as :class:`UnknownEvent`. A missing directory yields nothing.
    """
    out: list[Event] = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        out.extend(_file_events(path))
    out.sort(key=lambda e: e.time)
    yield from out


# -- the run index -------------------------------------------------------------------------


@dataclass(frozen=True)
class RunIndexEntry:
    """Where one run keeps its state (what :func:`record_run` wrote)."""

    run_id: str
    state_dir: str
    events_dir: str
    checkpoint_dir: str | None = None
    log_dir: str | None = None
    time: float = 0.0


def run_index_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The per-user run index: ``$XDG_STATE_HOME/slurm_elastic/runs`` (else
    ``~/.local/state/slurm_elastic/runs``)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_STATE_HOME") or os.path.join(
        env.get("HOME") or os.path.expanduser("~"), ".local", "state"
    )
    return Path(base) / "slurm_elastic" / "runs"


def record_run(
    run_id: str,
    *,
    state_dir: str | os.PathLike[str],
    events_dir: str | os.PathLike[str],
    checkpoint_dir: str | os.PathLike[str] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
) -> None:
    """Record where run ``run_id`` keeps its state in the per-user run index.

    Written by every agent at start (atomically, 0600); never raises (best effort).
    """
    entry = RunIndexEntry(
        run_id=run_id,
        state_dir=os.path.abspath(state_dir),
        events_dir=os.path.abspath(events_dir),
        checkpoint_dir=None if checkpoint_dir is None else os.path.abspath(checkpoint_dir),
        log_dir=None if log_dir is None else os.path.abspath(log_dir),
        time=time.time(),
    )
    try:
        directory = run_index_dir()
        ensure_private_dir(directory, root=directory.parent)
        tmp = directory / f".{run_id}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(dataclasses.asdict(entry), fh)
        os.replace(tmp, directory / f"{run_id}.json")
    except (OSError, ValueError, UnsafeDirectoryError) as exc:
        log.debug("cannot record run %s in the run index: %s", run_id, exc)


def find_run(run_id: str) -> RunIndexEntry | None:
    """The run index entry of ``run_id``; ``None`` when there is none or it is not ours.

    An entry not owned by this user, or a link, is ignored (it could point anywhere).
    """
    path = run_index_dir() / f"{run_id}.json"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, encoding="utf-8") as fh:
        info = os.fstat(fh.fileno())
        if info.st_uid != os.getuid() or not stat.S_ISREG(info.st_mode):
            log.warning("ignoring run index entry %s: not a file of this user", path)
            return None
        try:
            data = json.load(fh)
            return RunIndexEntry(**{k: data[k] for k in data if k in RunIndexEntry.__annotations__})
        except (ValueError, TypeError) as exc:
            log.warning("ignoring unreadable run index entry %s: %s", path, exc)
            return None
