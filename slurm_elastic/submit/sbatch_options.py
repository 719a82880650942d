"""The Slurm request options a job file may set: one table for the ``#SBATCH`` lines.

:data:`SBATCH_OPTIONS` maps each template key that is a Slurm request option to its
``#SBATCH`` flag in the rendered templates (:mod:`slurm_elastic.submit.render`), with the
check that refuses a bad value at render time rather than in sbatch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from slurm_elastic.submit.value_checks import int_value, slurm_time_minutes

__all__ = ["SBATCH_OPTIONS", "SbatchOption"]


@dataclass(frozen=True)
class SbatchOption:
    """One template key that is a Slurm request option (an ``#SBATCH`` line).

    Attributes:
        key: the template key (``partition``).
        flag: the sbatch option of the rendered template (``--partition``).
        boolean: a flag without a value (``--exclusive``), given when the value is true.
        check: validates the value at render time (raises ``ConfigError`` naming it), so
            a bad value fails here, not in sbatch.
    """

    key: str
    flag: str
    boolean: bool = False
    check: Callable[[object], object] | None = None


def _cpus(value: object) -> int:
    return int_value("cpus_per_task", value, 1)


#: The one mapping of template keys to Slurm options (``#SBATCH`` lines).
SBATCH_OPTIONS: tuple[SbatchOption, ...] = (
    SbatchOption("partition", "--partition"),
    SbatchOption("account", "--account"),
    SbatchOption("qos", "--qos"),
    SbatchOption("time", "--time", check=slurm_time_minutes),
    SbatchOption("constraint", "--constraint"),
    SbatchOption("mem", "--mem"),
    SbatchOption("gpus_per_node", "--gpus-per-node"),
    SbatchOption("cpus_per_task", "--cpus-per-task", check=_cpus),
    SbatchOption("exclusive", "--exclusive", boolean=True),
)
