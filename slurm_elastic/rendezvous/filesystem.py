"""The rendezvous' directories: the shared private-filesystem layer, worded for it.

Everything the rendezvous does on the shared filesystem goes through
:class:`RendezvousDir`, a :class:`~slurm_elastic.privatefs.SafeDir` (an open, checked
directory: every operation relative to its descriptor, never through a link) whose
errors are :class:`~slurm_elastic.errors.RendezvousSetupError`. The primitives it relies
on (see ``docs/rendezvous.md``):

* ``mkdir`` (exclusive by nature) and ``rename`` of a freshly built directory,
* ``open(O_CREAT | O_EXCL | O_NOFOLLOW)`` of private temporary files,
* ``link(tmp, name)``: an *exclusive*, atomic publication of an immutable file,
* ``rename(tmp, name)``: an atomic replacement of a small pointer file,
* ``unlink``, ``listdir`` and ``open(O_NOFOLLOW)`` for reading.

No ``flock``/``fcntl`` lock is ever taken: a process that dies at any point leaves at
worst an orphaned temporary file, never a lock that blocks the job.

Security (:meth:`~slurm_elastic.privatefs.SafeDir.open_tree`): the path is walked
component by component from a *user-owned anchor* with ``O_NOFOLLOW | O_DIRECTORY``;
every directory from the anchor down must be owned by the user, must not be a symlink,
and (below the anchor) must not be writable by group/others unless it has the sticky
bit; the directories the rendezvous uses must not be writable by group/others at all.
Missing directories are created ``0700`` exactly. Files are created ``0600``.

:data:`FS_OPS` counts the metadata operations of this process (``open``, ``stat``,
``link``, ``rename``, ``unlink``, ``mkdir``, ``listdir``) for the benchmark.
"""

from __future__ import annotations

from slurm_elastic.errors import MissingDirectoryError, RendezvousSetupError
from slurm_elastic.privatefs import FS_OPS, FsOps, SafeDir

__all__ = ["FS_OPS", "FsOps", "MissingDirectoryError", "RendezvousDir"]


class RendezvousDir(SafeDir):
    """A checked rendezvous directory held open (errors: ``RendezvousSetupError``)."""

    @classmethod
    def _refuse(cls, problem: str) -> Exception:
        return RendezvousSetupError(
            f"unsafe rendezvous directory: {problem} (someone else could rewrite the "
            "rendezvous state)"
        )

    @classmethod
    def _missing(cls, path: str) -> Exception:
        return MissingDirectoryError(
            f"rendezvous directory {path} does not exist; create it on the shared "
            "filesystem or point the endpoint at an existing one"
        )

    @classmethod
    def _failed(cls, path: str, exc: OSError, doing: str) -> Exception:
        return RendezvousSetupError(
            f"cannot {doing} rendezvous directory {path}: {exc.strerror or exc}; choose a "
            "writable directory on the shared filesystem that you can reach"
        )
