"""The event record's layout: the fields every event carries, and :class:`Event`.

A record (one JSON object per line) holds ``v`` (the schema version,
:data:`SCHEMA_VERSION`), ``kind``, ``time`` (Unix seconds, float), ``host``, ``pid``,
``run_id``, then the fields of its kind (:mod:`~slurm_elastic.events.kinds`). Events also
read like the record mapping (``e["step"]``, ``e.get("step")``) so that code written
against the untyped records keeps working.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from slurm_elastic.envvars import RUN_ID_ENV

__all__ = [
    "BASE_FIELDS",
    "SCHEMA_VERSION",
    "Event",
    "UnknownEvent",
    "current_host",
    "current_run_id",
]

#: The version of the record layout; readers accept every version (see the module doc).
SCHEMA_VERSION = 1

#: The fields every record carries (not part of a kind's own fields).
BASE_FIELDS = ("v", "kind", "time", "host", "pid", "run_id")


def current_host() -> str:
    """The writing node: ``SLURMD_NODENAME``, else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def current_run_id() -> str | None:
    """The writing process's run (``SLURM_ELASTIC_RUN_ID``), ``None`` outside a run."""
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
    host: str = field(default_factory=current_host)
    pid: int = field(default_factory=os.getpid)
    run_id: str | None = field(default_factory=current_run_id)
    v: int = SCHEMA_VERSION
    extra: Mapping[str, Any] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        """The kind's own fields and the extra ones (no base fields)."""
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in BASE_FIELDS and f.name != "extra"
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
