"""The error tree of slurm_elastic.

Every error raised on purpose by this package derives from :class:`SlurmElasticError`,
so ``except SlurmElasticError`` catches all of them. Messages say what failed, the value
involved, and how to fix it.

::

    SlurmElasticError
    ├── ConfigError                    (also ValueError) bad key, type or value
    ├── SlurmError                     a Slurm interaction failed
    │   ├── SlurmEnvError              a malformed SLURM_* variable
    │   ├── SlurmCommandNotFoundError  sbatch/squeue/... not on PATH
    │   ├── SlurmControllerError       slurmctld unreachable / not responding
    │   └── SlurmCommandError          a command exited non-zero or timed out
    ├── RendezvousSetupError           unsafe or unusable rendezvous directory
    │                                  (rendezvous.errors adds subclasses of torch's
    │                                  RendezvousError too, so torch's agent handles them)
    ├── CheckpointError                a checkpoint could not be written or read
    │   ├── CheckpointWriteError       ENOSPC, EACCES, EROFS ...: nothing was lost
    │   ├── CheckpointCorruptError     a checkpoint failed verification
    │   ├── CheckpointReadError        the node or filesystem failed a read (ENOMEM,
    │   │                              EIO, a missing device): not damage, kept
    │   ├── ForeignRunError            the directory holds another run's checkpoints
    │   └── CheckpointMismatchError    a state does not match the model/optimizer
    ├── StateExchangeError             a value a peer sent was refused (malformed, too
    │                                  large, or not this rank's structure): nothing of
    │                                  the receiver's was replaced
    ├── UnsafeDirectoryError           a directory of ours is a link, not ours, or
    │                                  writable by group/others (the chmod to run)
    └── AgentError                     the per-node agent cannot run
"""

from __future__ import annotations

__all__ = [
    "AgentError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointReadError",
    "CheckpointWriteError",
    "ConfigError",
    "ForeignRunError",
    "RendezvousSetupError",
    "SlurmCommandError",
    "SlurmCommandNotFoundError",
    "SlurmControllerError",
    "SlurmElasticError",
    "SlurmEnvError",
    "SlurmError",
    "StateExchangeError",
    "UnsafeDirectoryError",
]


class SlurmElasticError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(SlurmElasticError, ValueError):
    """A configuration key, type or value is invalid (the message names key, value, rule)."""


class SlurmError(SlurmElasticError):
    """An interaction with Slurm failed."""


class SlurmEnvError(SlurmError):
    """A ``SLURM_*`` environment variable is malformed."""


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


class RendezvousSetupError(SlurmElasticError):
    """The rendezvous directory is unsafe or unusable."""


class CheckpointError(SlurmElasticError):
    """A checkpoint could not be written or read."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed; the previous checkpoints are intact."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint is incomplete or failed its checksum verification."""


class CheckpointReadError(CheckpointError):
    """A checkpoint could not be read because of the node or the filesystem (an I/O or
    memory error, a device that does not exist here). It is not damaged and is left in
    place; fix the cause and retry."""


class ForeignRunError(CheckpointError):
    """A checkpoint directory holds another run's checkpoints: never loaded or pruned."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's state does not match the model/optimizer it is loaded into."""


class StateExchangeError(SlurmElasticError):
    """A value received from a peer was refused, on every rank of the exchange.

    Raised when what a peer sent is malformed, larger than allowed, or does not match the
    receiver's own state (keys, shapes, dtypes); nothing of the receiver's was replaced.
    """


class UnsafeDirectoryError(SlurmElasticError, PermissionError):
    """A directory of the product's own tree is a link, not a directory, owned by someone
    else, or writable by group/others; the message names it and the fix. Also a
    ``PermissionError``, so code that handles an unusable directory (``OSError``) handles
    this one too."""


class AgentError(SlurmElasticError):
    """The per-node agent cannot run (bad arguments, unusable environment)."""
