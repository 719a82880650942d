"""Writing events: :func:`emit` appends one record to this process's own file.

The sink is the directory named by ``SLURM_ELASTIC_EVENTS_DIR`` (the agent sets it for its
workers); with none, :func:`emit` does nothing, so library code may call it
unconditionally. One file per writer (``<host>.<pid>.jsonl``), so writers on different
nodes never interleave partial lines on a shared filesystem; created 0600 and opened
without following a symbolic link (the directory lives on a shared filesystem).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from slurm_elastic.envvars import EVENTS_DIR_ENV
from slurm_elastic.errors import UnsafeDirectoryError
from slurm_elastic.events.records import event_from_fields
from slurm_elastic.events.schema import Event
from slurm_elastic.privatefs import ensure_private_dir, open_writable

__all__ = ["emit"]

log = logging.getLogger(__name__)


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
        typed = event_from_fields(event, fields) if isinstance(event, str) else event
        line = json.dumps(typed.to_record(), default=str) + "\n"
        path = Path(directory) / f"{typed.host}.{typed.pid}.jsonl"
        ensure_private_dir(path.parent)
        # Appended: each write of one line lands whole at the end of our own file; a
        # link, a FIFO or another user's file planted at the name is refused.
        fd = open_writable(path, append=True)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except (OSError, TypeError, ValueError, UnsafeDirectoryError) as exc:
        name = event if isinstance(event, str) else event.kind
        log.debug("dropping event %s: %s", name, exc)
