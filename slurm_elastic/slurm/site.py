"""What this Slurm installation is and how its site configured it: pure parsers.

* :class:`SlurmVersion` from ``sbatch --version`` / ``scontrol --version``
  (``slurm 25.11.0``, Debian's ``slurm-wlm 22.05.8``); :data:`EXPEDITED_REQUEUE_SINCE` is
  the first release with ``sbatch --requeue=expedite``.
* :func:`parse_key_values` reads ``scontrol show config`` (``Key = value`` lines) and
  :func:`parse_partition` one ``scontrol show partition --oneliner NAME`` record; the
  preemption window needs ``KillWait`` (config) and ``GraceTime`` (partition).

The commands run in :class:`slurm_elastic.slurm.commands.SlurmClient`; these functions
are tested on output recorded from the local Slurm 22.05 (``tests/data/slurm/``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from slurm_elastic.slurm.parse import SlurmParseError, parse_scontrol_show_job

__all__ = [
    "EXPEDITED_REQUEUE_SINCE",
    "PartitionInfo",
    "SlurmVersion",
    "parse_duration_s",
    "parse_key_values",
    "parse_partition",
    "parse_version",
]

_VERSION = re.compile(r"(?:^|\s)(\d{2})\.(\d{1,2})(?:\.(\d+))?")
#: ``KillWait = 30 sec``; ``OverTimeLimit = 0 min``; ``UNLIMITED`` has no unit.
_DURATION = re.compile(r"^\s*(\d+)\s*(sec|secs|seconds|min|mins|minutes)?\s*$", re.IGNORECASE)


@dataclass(frozen=True, order=True)
class SlurmVersion:
    """A Slurm release (``25.11.0``); ordered, so ``version >= EXPEDITED_REQUEUE_SINCE``."""

    major: int
    minor: int
    micro: int = 0

    def __str__(self) -> str:
        return f"{self.major}.{self.minor:02d}.{self.micro}"


#: ``sbatch --requeue=expedite`` (Slurm 25.11 release notes: "Expedited Requeue").
EXPEDITED_REQUEUE_SINCE = SlurmVersion(25, 11, 0)


def parse_version(text: str) -> SlurmVersion:
    """The version in ``sbatch --version`` output (``slurm 25.11.0``, ``slurm-wlm 22.05.8``).

    Raises:
        SlurmParseError: no ``YY.MM[.N]`` version in the text.
    """
    match = _VERSION.search(text.strip())
    if match is None:
        raise SlurmParseError(
            f"'sbatch --version' printed {text.strip()[:200]!r}, expected e.g. 'slurm 25.11.0'; "
            "check that sbatch on PATH is Slurm's"
        )
    return SlurmVersion(int(match.group(1)), int(match.group(2)), int(match.group(3) or 0))


def parse_key_values(text: str) -> dict[str, str]:
    """``scontrol show config``: ``Key = value`` lines -> mapping (other lines skipped)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        key = key.strip()
        if sep and key and " " not in key:
            out.setdefault(key, value.strip())
    return out


def parse_duration_s(value: str | None) -> float | None:
    """Seconds of a ``scontrol`` duration (``30 sec``, ``2 min``, ``20``); ``None`` if not one."""
    if value is None:
        return None
    match = _DURATION.match(value)
    if match is None:
        return None
    unit = (match.group(2) or "sec").lower()
    return float(match.group(1)) * (60.0 if unit.startswith("min") else 1.0)


@dataclass(frozen=True)
class PartitionInfo:
    """The preemption settings of one partition.

    Attributes:
        name: the partition's name.
        grace_time_s: ``GraceTime``: seconds between the preemption notice and SIGTERM.
        preempt_mode: ``PreemptMode`` (``REQUEUE``, ``CANCEL``, ``OFF``, ...).
        default: whether it is the cluster's default partition.
    """

    name: str
    grace_time_s: float
    preempt_mode: str
    default: bool


def parse_partition(text: str) -> list[PartitionInfo]:
    """``scontrol show partition --oneliner``: one :class:`PartitionInfo` per record.

    Raises:
        SlurmParseError: a record without ``PartitionName`` or with a non-numeric GraceTime.
    """
    out: list[PartitionInfo] = []
    for record in parse_scontrol_show_job(text):
        name = record.get("PartitionName")
        grace = record.get("GraceTime", "0")
        if not name or not grace.strip().isdigit():
            raise SlurmParseError(
                f"scontrol show partition printed a record without a name or with "
                f"GraceTime={grace!r}: {sorted(record)[:8]}"
            )
        out.append(
            PartitionInfo(
                name=name,
                grace_time_s=float(grace),
                preempt_mode=record.get("PreemptMode", "") or "",
                default=record.get("Default", "NO").upper() == "YES",
            )
        )
    return out
