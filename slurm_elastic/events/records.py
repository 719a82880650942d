"""From a decoded record back to its typed event, with the reader's type checks.

A reader keeps what it does not know: a record of an unknown kind becomes an
:class:`~slurm_elastic.events.schema.UnknownEvent`, undeclared fields go to ``extra``, a
missing declared field gets its default. Read from a file (``strict``), a field not of
its declared type refuses the record: integers are bounded and floats finite, so what a
reader accepts cannot overflow the arithmetic of a summary.
"""

from __future__ import annotations

import dataclasses
import os
import time
import types
import typing
from collections.abc import Mapping
from typing import Any

from slurm_elastic.events.kinds import EVENT_TYPES
from slurm_elastic.events.schema import (
    BASE_FIELDS,
    SCHEMA_VERSION,
    Event,
    UnknownEvent,
    current_host,
    current_run_id,
)

__all__ = ["event_from_fields", "event_from_record"]


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
    rest = {k: v for k, v in record.items() if k not in BASE_FIELDS}
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        return UnknownEvent(kind=kind, extra=rest, **base)
    declared = {f.name for f in dataclasses.fields(cls)} - set(BASE_FIELDS) - {"extra"}
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


def event_from_fields(kind: str, fields: Mapping[str, Any]) -> Event:
    """``emit("kind", **fields)``: the typed event of a kind given by name."""
    fields = dict(fields)
    if "kind" in fields:  # the old sharded checkpoint events said kind="sharded"
        fields["format"] = fields.pop("kind")
    record = {"kind": kind, "time": time.time(), "host": current_host(), "pid": os.getpid()}
    record["run_id"] = current_run_id()
    record["v"] = SCHEMA_VERSION
    return event_from_record({**fields, **record})
