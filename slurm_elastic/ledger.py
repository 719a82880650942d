"""A sample ledger: which samples every step consumed, to check "each sample once per epoch".

slurm_elastic promises that across membership changes, restarts and requeues every sample
of an epoch reaches the final model exactly once. A ledger makes that promise checkable
on a real run: each rank appends one JSON line per step (:func:`append`) *at the start* of
the step, naming the step, its epoch, the rank, the world size, the sample indices and
the attempt (the in-place round or the restart that runs it). The examples write it with
``--ledger``; the tests and the benchmarks judge it with :func:`check` (one rule for all).

A step can be started more than once: a group of workers stopped before its next commit
or checkpoint is rolled back, and the next group does those steps again. The *effective*
attempt of a step is the one that started last (its records carry the newest time);
the others never reached the model. So:

* :func:`effective` keeps, per ``(epoch, step)``, the records of its last attempt;
* :func:`check` lists what breaks the promise: a step missing, a step not run by every
  rank of its world exactly once, a sample used twice in an epoch, an epoch before the
  last that misses samples;
* :func:`redone_steps` counts the steps that were started more than once (the work a
  change cost).

Torch-free, dependency-free: a reader of a ledger that workers still append to
(:func:`read`) counts complete lines only.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "Record",
    "append",
    "check",
    "effective",
    "read",
    "redone_steps",
    "samples_per_epoch",
    "steps_done",
]

Record = dict[str, Any]


def append(
    path: str | os.PathLike[str],
    *,
    epoch: int,
    step: int,
    rank: int,
    world: int,
    indices: Sequence[int],
    attempt: str | int,
    **extra: Any,
) -> None:
    """Append this rank's record of ``step`` (call it when the step starts).

    Args:
        path: the ledger file, shared by all ranks (one ``O_APPEND`` write per record:
            lines of concurrent writers do not interleave on a local or parallel
            filesystem for lines this short).
        epoch: the epoch the step belongs to.
        step: the step number (1-based, counted across epochs).
        rank, world: this rank and the world size of the step.
        indices: the sample indices this rank consumes in the step.
        attempt: what runs the step (e.g. ``"round3"``, a restart count): two records
            of one step with different attempts are two attempts at it.
        extra: more fields to record (e.g. ``round``, ``pid``).
    """
    record = {
        "epoch": int(epoch),
        "step": int(step),
        "rank": int(rank),
        "world": int(world),
        "indices": [int(i) for i in indices],
        "attempt": str(attempt),
        **extra,
        "time": time.time(),
    }
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read(*paths: str | os.PathLike[str]) -> list[Record]:
    """The records of ledger files that writers may be appending to right now.

    Only complete lines count: a last line without its newline is a write in flight (a
    reader can see part of an ``O_APPEND`` write) and is left for the next read. A
    missing file has no records. A complete line that does not parse is a real defect
    and raises :class:`ValueError` naming the file and line.
    """
    out: list[Record] = []
    for path in paths:
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            continue
        complete = data[: data.rfind(b"\n") + 1].decode()
        for n, line in enumerate(complete.splitlines(), 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{os.fspath(path)}:{n}: not a ledger record: {exc}") from exc
    return out


def _attempt(record: Record) -> str:
    return str(record.get("attempt", record.get("round", "")))


def _time(record: Record) -> float:
    return float(record.get("time", 0.0))


def effective(
    records: Iterable[Record], *, so_far: bool = False
) -> dict[tuple[int, int], list[Record]]:
    """Per ``(epoch, step)``, the records of the step's last attempt (sorted by key).

    ``so_far``: for a run that is still training, leave out the steps beyond the newest
    record's step: an older attempt's steps there are still to be redone by the current
    one.
    """
    attempts: dict[tuple[int, int], dict[str, list[Record]]] = defaultdict(dict)
    records = list(records)
    for rec in records:
        attempts[(rec["epoch"], rec["step"])].setdefault(_attempt(rec), []).append(rec)
    newest = max(records, key=_time, default=None)
    out: dict[tuple[int, int], list[Record]] = {}
    for key in sorted(attempts):
        if so_far and newest is not None and key > (newest["epoch"], newest["step"]):
            continue
        out[key] = max(attempts[key].values(), key=lambda recs: max(map(_time, recs)))
    return out


def samples_per_epoch(records: Iterable[Record], *, so_far: bool = False) -> dict[int, list[int]]:
    """The samples that reached the model, per epoch (of the effective attempts)."""
    out: dict[int, list[int]] = defaultdict(list)
    for (epoch, _), recs in effective(records, so_far=so_far).items():
        for rec in recs:
            out[epoch].extend(rec["indices"])
    return dict(out)


def check(
    records: Iterable[Record],
    dataset_size: int,
    *,
    steps: int | None = None,
    epochs: int | None = None,
    so_far: bool = False,
    whole_steps: bool = True,
) -> list[str]:
    """What breaks "each sample once per epoch" in ``records`` (empty: nothing).

    Args:
        records: the ledger's records (from :func:`read`).
        dataset_size: samples per epoch: every epoch before the last must use each of
            ``range(dataset_size)`` exactly once.
        steps: the run's step count: steps ``1..steps`` must all be there.
        epochs: the run's epoch count: epochs ``0..epochs-1`` must all be there, the
            last one complete too (default: the last epoch may be partial).
        so_far: the run still trains (see :func:`effective`); the newest step may still
            miss some ranks' records and the last epoch is not judged complete.
        whole_steps: every effective step has one record per rank of its world
            (False for ledgers that record no ranks, e.g. one file per rank).
    """
    records = list(records)
    problems: list[str] = []
    eff = effective(records, so_far=so_far)
    if steps is not None:
        missing = sorted(set(range(1, steps + 1)) - {step for _, step in eff})
        if missing:
            problems.append(f"{len(missing)} steps missing from the ledger, first {missing[:5]}")
    newest = max(eff, default=None)
    if whole_steps:
        for key, recs in eff.items():
            if so_far and key == newest:
                continue
            ranks = sorted(r["rank"] for r in recs)
            if ranks != list(range(recs[0]["world"])):
                problems.append(
                    f"epoch {key[0]} step {key[1]}: ranks {ranks} ran it, its world is "
                    f"{recs[0]['world']}"
                )
    per_epoch = samples_per_epoch(records, so_far=so_far)
    last = max(per_epoch, default=None)
    if epochs is not None:
        if sorted(per_epoch) != list(range(epochs)):
            problems.append(f"epochs {sorted(per_epoch)} in the ledger, expected 0..{epochs - 1}")
        last = None  # every epoch must be complete
    for epoch, seen in sorted(per_epoch.items()):
        twice = len(seen) - len(set(seen))
        if twice:
            problems.append(f"epoch {epoch}: {twice} samples used twice")
        if epoch != last and sorted(set(seen)) != list(range(dataset_size)):
            absent = len(set(range(dataset_size)) - set(seen))
            problems.append(f"epoch {epoch}: {absent} of {dataset_size} samples missing")
    return problems


def redone_steps(records: Iterable[Record]) -> int:
    """How many steps were started by more than one attempt (rolled back and redone)."""
    attempts: dict[tuple[int, int], set[str]] = defaultdict(set)
    for rec in records:
        attempts[(rec["epoch"], rec["step"])].add(_attempt(rec))
    return sum(1 for a in attempts.values() if len(a) > 1)


def steps_done(records: Iterable[Record]) -> int:
    """The highest step number started so far (0 for none)."""
    return max((r["step"] for r in records), default=0)
