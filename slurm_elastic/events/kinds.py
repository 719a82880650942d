"""Every kind of event: one frozen dataclass per kind, registered under its ``kind``.

The kinds are grouped by who emits them: the agent, the rendezvous, the checkpoints, the
training loop, and the in-place membership changes (:mod:`slurm_elastic.live`).
:data:`EVENT_TYPES` maps each ``kind`` string to its class (what a reader turns a record
into). New fields are added with defaults, never renamed (the module doc of
:mod:`slurm_elastic.events`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from slurm_elastic.events.schema import Event

__all__ = [
    "EVENT_TYPES",
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
    "LiveCollectiveAborted",
    "LiveDone",
    "LiveLeft",
    "LivePeerFailure",
    "LiveReformed",
    "LiveStart",
    "RendezvousComplete",
    "RendezvousEvicted",
    "RendezvousLeft",
    "TrainDone",
    "TrainPreempted",
    "TrainProgress",
    "TrainStart",
    "WorkersStarted",
    "WorkersSucceeded",
]

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
    era: int = 0
    rank: int = 0
    world_size: int = 0
    node: str = ""
    store: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class RendezvousEvicted(Event):
    """Nodes found dead were evicted: ``cause`` ``heartbeat`` (the counter stood still
    for the window), ``link`` (the agent's verified connection closed: the process is
    gone) or ``unreachable`` (the agent runs, its heartbeat goes on, but its watcher's
    link went unanswered for the window: a network partition)."""

    kind: ClassVar[str] = "rendezvous.evicted"
    nodes: list[str] = field(default_factory=list)
    cause: str = "heartbeat"


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
    #: where the start's time went, in seconds: in place ``connect_s`` (the round's
    #: store), ``join_s`` (the process group: waits for every rank of the round, e.g.
    #: survivors switching at their next boundary), ``state_s`` (the newest commit from a
    #: peer); ``resume_s`` (a checkpoint, when no peer had a commit) and ``wrap_s``
    #: (DDP's wrapper or FSDP2's sharding)
    phases_s: Mapping[str, float] = field(default_factory=dict)


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
class LiveWorkerStuck(Event):
    """A worker's aborted collective did not end within ``stuck_s``: the worker exits so
    that its agent restarts the node's workers (they rejoin from their peers' state)."""

    kind: ClassVar[str] = "live.worker_stuck"
    round: int = 0
    new_round: int = 0
    stuck_s: float = 0.0


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
