"""Structured events written by agents, rendezvous and checkpoints.

An event is one JSON object per line, appended to ``<events_dir>/<host>.<pid>.jsonl``
(one file per writer, so writers on different nodes never interleave partial lines on
a shared filesystem). Later tooling (``slurm-elastic status``/``logs``/``timeline``)
merges the files by ``time``.

Record fields: ``time`` (Unix seconds, float), ``kind`` (e.g. ``"rendezvous.complete"``),
``host``, ``pid``, ``run_id`` and whatever keyword fields the emitter adds (JSON-able).

The sink is chosen by the ``SLURM_ELASTIC_EVENTS_DIR`` environment variable, which the
agent sets for its workers; with no sink configured :func:`emit` does nothing, so library
code may call it unconditionally.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from slurm_elastic.envvars import EVENTS_DIR_ENV, RUN_ID_ENV

__all__ = ["EVENTS_DIR_ENV", "emit", "read_events"]


log = logging.getLogger(__name__)


def emit(kind: str, /, **fields: Any) -> None:
    """Append one event record to this process's event file, if a sink is configured.

    Never raises: an event that cannot be written is logged at DEBUG and dropped, because
    observability must not take training down.
    """
    directory = os.environ.get(EVENTS_DIR_ENV)
    if not directory:
        return
    host = socket.gethostname()
    record = {
        "time": time.time(),
        "kind": kind,
        "host": os.environ.get("SLURMD_NODENAME", host),
        "pid": os.getpid(),
        "run_id": os.environ.get(RUN_ID_ENV),
        **fields,
    }
    try:
        line = json.dumps(record, default=str) + "\n"
        path = Path(directory) / f"{record['host']}.{record['pid']}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND: each write of one line lands whole at the end of our own file.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except (OSError, TypeError, ValueError) as exc:
        log.debug("dropping event %s: %s", kind, exc)


def read_events(directory: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield every well-formed event under ``directory``, ordered by time."""
    records: list[dict[str, Any]] = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line of a writer that died mid-write
                if isinstance(rec, dict) and "time" in rec and "kind" in rec:
                    records.append(rec)
    records.sort(key=lambda r: r["time"])
    yield from records
