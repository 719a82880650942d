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

The directory stays bounded over a long job: each agent merges the files of its node's
processes that are gone into the node's archive, ``<host>.archive.jsonl``
(:func:`compact`, before each start of its workers and at each in-place re-formation).

The run index (:func:`record_run`, :func:`find_run`, :func:`list_runs`) maps a run id (the
Slurm job id) to its state, events and checkpoint directories, so ``slurm-elastic status
JOB`` finds a run after Slurm forgot the job and ``slurm-elastic status`` lists the runs.

The package, one module per concept: :mod:`~slurm_elastic.events.schema` (the record
layout and :class:`Event`), :mod:`~slurm_elastic.events.kinds` (every kind,
:data:`EVENT_TYPES`), :mod:`~slurm_elastic.events.records` (a record back to its typed
event, type-checked), :mod:`~slurm_elastic.events.writer` (:func:`emit`),
:mod:`~slurm_elastic.events.reader` (:func:`read_events`),
:mod:`~slurm_elastic.events.compact` (:func:`compact`) and
:mod:`~slurm_elastic.events.run_index` (:func:`record_run`, :func:`find_run`,
:func:`list_runs`). Everything
is importable from here (``from slurm_elastic import events; events.emit(...)``).
"""

from slurm_elastic.envvars import EVENTS_DIR_ENV
from slurm_elastic.events.compact import ARCHIVE, compact
from slurm_elastic.events.kinds import (
    EVENT_TYPES,
    AgentExit,
    AgentGaveUp,
    AgentHang,
    AgentLeaveInPlace,
    AgentReformedInPlace,
    AgentRequeued,
    AgentRestart,
    AgentSignal,
    AgentStart,
    AgentTerminated,
    AgentWindow,
    CheckpointFailed,
    CheckpointLoaded,
    CheckpointRemoved,
    CheckpointSaved,
    CheckpointSkipped,
    LiveCollectiveAborted,
    LiveDone,
    LiveLeft,
    LivePeerFailure,
    LiveReformed,
    LiveStart,
    LiveWorkerStuck,
    RendezvousComplete,
    RendezvousEvicted,
    RendezvousLeft,
    TrainDone,
    TrainPreempted,
    TrainProgress,
    TrainStart,
    WorkersStarted,
    WorkersSucceeded,
)
from slurm_elastic.events.reader import MAX_EVENTS_FILE_BYTES, MAX_RECORD_BYTES, read_events
from slurm_elastic.events.records import event_from_record
from slurm_elastic.events.run_index import (
    RunIndexEntry,
    find_run,
    list_runs,
    record_run,
    run_index_dir,
)
from slurm_elastic.events.schema import SCHEMA_VERSION, Event, UnknownEvent
from slurm_elastic.events.writer import emit

__all__ = [
    "ARCHIVE",
    "EVENTS_DIR_ENV",
    "EVENT_TYPES",
    "MAX_EVENTS_FILE_BYTES",
    "MAX_RECORD_BYTES",
    "SCHEMA_VERSION",
    "AgentExit",
    "AgentGaveUp",
    "AgentHang",
    "AgentLeaveInPlace",
    "AgentReformedInPlace",
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
    "LiveDone",
    "LiveLeft",
    "LivePeerFailure",
    "LiveReformed",
    "LiveStart",
    "LiveWorkerStuck",
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
    "compact",
    "emit",
    "event_from_record",
    "find_run",
    "list_runs",
    "read_events",
    "record_run",
    "run_index_dir",
]
