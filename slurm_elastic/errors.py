"""The error tree of slurm_elastic.

Every exception class of this package derives from :class:`SlurmElasticError`, so
``except SlurmElasticError`` catches all of them; every one is defined here, except
:class:`~slurm_elastic.rendezvous.state.MalformedRecordError`, whose second base is
torch's and so lives beside the torch import. Messages say what failed, the value
involved, and how to fix it. A second base in parentheses is a mixin: code that catches
the builtin (``ValueError``, ``TimeoutError``, ...) catches ours too.

::

    SlurmElasticError
    ├── ConfigError                    (also ValueError) bad key, type or value
    ├── SlurmError                     a Slurm interaction failed
    │   ├── SlurmEnvError              a malformed SLURM_* variable
    │   ├── SlurmParseError            (also ValueError) unreadable command output
    │   ├── SlurmCommandNotFoundError  sbatch/squeue/... not on PATH
    │   ├── SlurmControllerError       slurmctld unreachable / not responding
    │   └── SlurmCommandError          a command exited non-zero or timed out
    │       └── SlurmJobNotFoundError  Slurm does not know the job (or purged it)
    ├── JobTimeoutError                (also TimeoutError) a job outlived a wait's deadline
    ├── JobFailedError                 a job ended in another state than COMPLETED
    ├── RunNotFoundError               the CLI's JOB names no readable run
    ├── UnsafeFileError                a file of ours is a link, not a regular file, or
    │                                  not ours: never read or written
    ├── UnsupportedTorchError          (also ImportError) torch older than supported
    ├── RendezvousSetupError           unsafe or unusable rendezvous directory
    │   ├── MissingDirectoryError      a directory that must exist does not
    │   └── RunIdInUseError            another live job uses the run id
    ├── MalformedRecordError           (also torch's RendezvousStateError; defined in
    │                                  rendezvous/state.py) a state record failed a check
    ├── RoundLostError                 the round this node is in stopped being current
    │                                  (a member left or was evicted, or its store's
    │                                  host is gone): join the next one. Alias:
    │                                  RoundBrokenError
    ├── StoreUnansweredError           a call to a round's store was abandoned: its
    │                                  host did not answer (frozen?) or was not needed
    ├── CheckpointError                a checkpoint could not be written or read
    │   ├── CheckpointWriteError       ENOSPC, EACCES, EROFS ...: nothing was lost
    │   │   └── StagingConflict        a tensor changed while it was being staged
    │   ├── CheckpointFlushTimeout     (also TimeoutError) a flush gave up waiting
    │   ├── CheckpointCorruptError     a checkpoint failed verification
    │   ├── CheckpointReadError        the node or filesystem failed a read (ENOMEM,
    │   │                              EIO, a missing device): not damage, kept
    │   ├── UntrustedCheckpointError   owned by another user or writable by others
    │   ├── ForeignRunError            the directory holds another run's checkpoints
    │   ├── CheckpointMismatchError    a state does not match the model/optimizer
    │   └── UnsupportedStateError      (also TypeError) a value the own container
    │                                  does not store (the caller falls back)
    ├── StateExchangeError             a value a peer sent was refused (malformed, too
    │                                  large, or not this rank's structure): nothing of
    │                                  the receiver's was replaced
    ├── ShardsLostError                a peer's shards are gone, no newer full copy
    ├── ShardsNotKeptError             this rank's model is not sharded as FSDP2 does:
    │                                  it keeps no shard for a recovery
    ├── PeerLostError                  (also RuntimeError) a peer of the process group
    │   │                              is gone (its gloo group could not form)
    │   └── RoundSupersededError       a newer round is assigned while this one's store
    │                                  is unreachable or its group forms
    ├── ReformTimeoutError             (also RuntimeError) no new round came in time
    │                                  after a peer failed: restart instead
    ├── UnsafeDirectoryError           (also PermissionError) a directory of ours is a
    │                                  link, not ours, or writable by group/others
    ├── RecordError                    (also ValueError) a CRC-framed record failed a
    │                                  check (torn, bit-flipped, another number)
    └── AgentError                     the per-node agent cannot run

One warning, not an error: :class:`UntestedTorchWarning` (a ``UserWarning``), torch
newer than tested.

Errors torch raises pass through unchanged where the caller knows them (a rendezvous
handler raises torch's ``RendezvousError`` family, which torch's agent handles); a
failed peer is recognised by type, never by message: torch's ``DistError`` family, or
gloo's plain ``RuntimeError`` while the group's connections are down (see
:func:`slurm_elastic.live.world.is_peer_failure`).
"""

from __future__ import annotations

__all__ = [
    "AgentError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFlushTimeout",
    "CheckpointMismatchError",
    "CheckpointReadError",
    "CheckpointWriteError",
    "ConfigError",
    "ForeignRunError",
    "JobFailedError",
    "JobTimeoutError",
    "MissingDirectoryError",
    "PeerLostError",
    "ReformTimeoutError",
    "RendezvousSetupError",
    "RoundBrokenError",
    "RoundLostError",
    "RoundSupersededError",
    "RunIdInUseError",
    "RunNotFoundError",
    "ShardsLostError",
    "ShardsNotKeptError",
    "SlurmCommandError",
    "SlurmCommandNotFoundError",
    "SlurmControllerError",
    "SlurmElasticError",
    "SlurmEnvError",
    "SlurmError",
    "SlurmJobNotFoundError",
    "SlurmParseError",
    "StagingConflict",
    "StateExchangeError",
    "StoreUnansweredError",
    "UnsafeDirectoryError",
    "UnsafeFileError",
    "UnsupportedStateError",
    "UnsupportedTorchError",
    "UntestedTorchWarning",
    "UntrustedCheckpointError",
]


class SlurmElasticError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(SlurmElasticError, ValueError):
    """A configuration key, type or value is invalid (the message names key, value, rule)."""


# -- Slurm ------------------------------------------------------------------------------


class SlurmError(SlurmElasticError):
    """An interaction with Slurm failed."""


class SlurmEnvError(SlurmError):
    """A ``SLURM_*`` environment variable is malformed."""


class SlurmParseError(SlurmError, ValueError):
    """A Slurm command printed something this package cannot read."""


class SlurmCommandNotFoundError(SlurmError):
    """A Slurm client command (``sbatch``, ``squeue``, ...) is not on ``PATH``."""


class SlurmControllerError(SlurmError):
    """The Slurm controller (slurmctld) cannot be reached."""


class SlurmCommandError(SlurmError):
    """A Slurm command exited non-zero or timed out.

    Attributes:
        argv: the command line that was run.
        returncode: its exit status (``None`` on timeout).
        stderr: what it wrote on standard error.
    """

    def __init__(
        self, message: str, argv: list[str], returncode: int | None, stderr: str = ""
    ) -> None:
        super().__init__(message)
        self.argv = argv
        self.returncode = returncode
        self.stderr = stderr


class SlurmJobNotFoundError(SlurmCommandError):
    """Slurm does not know the job (never existed, or purged after ``MinJobAge``)."""


# -- jobs, runs, files ------------------------------------------------------------------


class JobTimeoutError(SlurmElasticError, TimeoutError):
    """A job did not finish before the deadline given to ``JobHandle.wait``."""


class JobFailedError(SlurmElasticError):
    """A job finished in another state than ``COMPLETED`` (``JobHandle.result``)."""


class RunNotFoundError(SlurmElasticError):
    """``JOB`` names no run this user can read."""


class UnsafeFileError(SlurmElasticError):
    """A file of ours that is not read or written: a link, not a regular file, not ours
    (the message says which and why)."""


class UnsupportedTorchError(SlurmElasticError, ImportError):
    """The installed torch is older than the range this package supports."""


class UntestedTorchWarning(UserWarning):
    """The installed torch is newer than the versions this package was tested with."""


# -- rendezvous -------------------------------------------------------------------------


class RendezvousSetupError(SlurmElasticError):
    """The rendezvous directory is unsafe or unusable."""


class MissingDirectoryError(RendezvousSetupError):
    """A directory that must exist (``create=False``) does not."""


class RunIdInUseError(RendezvousSetupError):
    """The run id is used by another live job (its epoch is open and changing), or was
    used by a job of another cluster (`agent/run_owner.py`)."""


class RoundLostError(SlurmElasticError):
    """The rendezvous round this node is in stopped being current: a member left or was
    evicted, or the host of the round's store is gone. Raised by the rendezvous (while
    the round's store is set up) and by the agent (while ranks are assigned); the caller
    joins the next round."""


#: The agent side's former name of :class:`RoundLostError` (one fact, one class).
RoundBrokenError = RoundLostError


class StoreUnansweredError(SlurmElasticError):
    """A call to a round's store was abandoned: its caller no longer needed the answer,
    or it outlived its limit (a frozen host accepts requests and never answers them;
    ``rendezvous/bounded_call.py``)."""


# -- checkpoints ------------------------------------------------------------------------


class CheckpointError(SlurmElasticError):
    """A checkpoint could not be written or read."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed; the previous checkpoints are intact."""


class StagingConflict(CheckpointWriteError):
    """A state tensor changed in place while it was being staged; nothing was written."""


class CheckpointFlushTimeout(CheckpointError, TimeoutError):
    """``CheckpointManager.flush`` gave up waiting; the save is still in flight."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint is incomplete or failed its checksum verification."""


class CheckpointReadError(CheckpointError):
    """A checkpoint could not be read because of the node or the filesystem (an I/O or
    memory error, a device that does not exist here). It is not damaged and is left in
    place; fix the cause and retry."""


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint path is owned by another user or writable by others: never read."""


class ForeignRunError(CheckpointError):
    """A checkpoint directory holds another run's checkpoints: never loaded or pruned."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's state does not match the model/optimizer it is loaded into."""


class UnsupportedStateError(CheckpointError, TypeError):
    """The state holds a value the own container format does not store (the serializer
    then uses ``torch.save``; the state exchange refuses the value)."""


# -- in-place training ------------------------------------------------------------------


class StateExchangeError(SlurmElasticError):
    """A value received from a peer was refused, on every rank of the exchange.

    Raised when what a peer sent is malformed, larger than allowed, or does not match the
    receiver's own state (keys, shapes, dtypes); nothing of the receiver's was replaced.
    """


class ShardsLostError(SlurmElasticError):
    """A peer's shards are gone and no full copy newer than the last step exists."""


class ShardsNotKeptError(SlurmElasticError):
    """This rank's module is not sharded as FSDP2 shards it: it keeps nothing."""


class PeerLostError(SlurmElasticError, RuntimeError):
    """A peer of the process group is gone: the group could not form (gloo could not
    connect to it). The in-place loop waits for the next round; also a ``RuntimeError``,
    the type torch's gloo error it replaces has."""


class RoundSupersededError(PeerLostError):
    """A newer round is assigned while this one's store is unreachable or its group is
    forming: the worker skips to it (a peer failure for the in-place loop, whose next
    round is there already)."""


class ReformTimeoutError(SlurmElasticError, RuntimeError):
    """No new round arrived in time after a peer failed: fall back to a restart."""


# -- the node ---------------------------------------------------------------------------


class UnsafeDirectoryError(SlurmElasticError, PermissionError):
    """A directory of the product's own tree is a link, not a directory, owned by someone
    else, or writable by group/others; the message names it and the fix. Also a
    ``PermissionError``, so code that handles an unusable directory (``OSError``) handles
    this one too."""


class RecordError(SlurmElasticError, ValueError):
    """A CRC-framed record (``privatefs/records.py``) failed a check: bad magic, torn,
    another number, a length or checksum mismatch; the message says which."""


class AgentError(SlurmElasticError):
    """The per-node agent cannot run (bad arguments, unusable environment)."""
