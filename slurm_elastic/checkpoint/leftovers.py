"""The temporary names of a checkpoint directory, and whether the writer of one is gone.

A save writes into ``.tmp-step_<N>-<id>-<pid>@<host>/``; a re-save of step N moves the
old copy aside to ``.replaced-step_...``; retention renames a checkpoint to
``.trash-step_...`` before deleting it. Each name carries its writer (pid and host), so
any later writer can tell a dead writer's leftover from a live one's: on this host by its
pid, on another host by activity (nothing in it changed for :data:`STALE_AFTER_S`).
Torch-free; :class:`~slurm_elastic.checkpoint.store.CheckpointStore` acts on the answers.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable, Collection

from slurm_elastic.errors import CheckpointError

__all__ = [
    "LEFTOVER_PREFIXES",
    "REPLACED_PREFIX",
    "STALE_AFTER_S",
    "TMP_PREFIX",
    "TRASH_PREFIX",
    "leftover_name",
    "replaced_step",
    "writer_dead",
]

TMP_PREFIX = ".tmp-step_"
REPLACED_PREFIX = ".replaced-step_"
TRASH_PREFIX = ".trash-step_"
LEFTOVER_PREFIXES = (TMP_PREFIX, REPLACED_PREFIX, TRASH_PREFIX)
#: A leftover of a writer on another host is stale when nothing in it changed for this long.
STALE_AFTER_S = 900.0
_LEFTOVER_RE = re.compile(
    r"^\.(?P<kind>tmp|replaced|trash)-step_(?P<step>\d+)-[0-9a-f]{12}"
    r"(?:-(?P<pid>\d+)@(?P<host>[^/]+))?$"
)


def leftover_name(prefix: str, step: int, host: str) -> str:
    """A fresh temporary name for ``step``, naming this process on ``host`` as its writer."""
    return f"{prefix}{step}-{uuid.uuid4().hex[:12]}-{os.getpid()}@{host}"


def replaced_step(name: str) -> int | None:
    """The step of a ``.replaced-step_`` name (an old copy moved aside), else ``None``."""
    match = _LEFTOVER_RE.match(name)
    if match is None or match.group("kind") != "replaced":
        return None
    return int(match.group("step"))


def writer_dead(
    name: str,
    *,
    host: str,
    active: Collection[str],
    newest_mtime: Callable[[str], float],
) -> bool:
    """Whether the writer of leftover ``name`` is gone (its leftover may be removed).

    Args:
        name: an entry of the checkpoint directory (not a leftover name: ``False``).
        host: this host's name.
        active: this process's own temporaries in flight (never dead).
        newest_mtime: the newest modification time under an entry (for a writer on
            another host, or a name without a writer); an error there means "alive".
    """
    match = _LEFTOVER_RE.match(name)
    if match is None:
        return False
    pid, writer_host = match.group("pid"), match.group("host")
    if pid is not None and writer_host == host:
        if int(pid) == os.getpid():
            return name not in active
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    try:  # another host (or an older name without a writer): judge by activity
        return time.time() - newest_mtime(name) > STALE_AFTER_S
    except (OSError, CheckpointError):
        return False
