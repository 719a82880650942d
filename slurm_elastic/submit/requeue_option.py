"""The sbatch requeue option of a job: ``--requeue``, or ``--requeue=expedite``.

Slurm 25.11 added expedited requeue (``sbatch --requeue=expedite``: a batch job requeued
after a node failure is eligible to restart at once, at top priority). The template key
``expedited_requeue: true`` asks for it; it is rendered only on a Slurm that has it, so
:func:`requeue_option` asks the Slurm in use for its version through a *probe* (default:
``sbatch --version``), and only then. Tests inject a probe (the seam), the CLI and
``submit`` use the real one, a local run passes a probe that says "no Slurm".
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from slurm_elastic.errors import ConfigError, SlurmError
from slurm_elastic.slurm.site import EXPEDITED_REQUEUE_SINCE, SlurmVersion

__all__ = ["VersionProbe", "installed_slurm_version", "requeue_option"]

#: Returns the Slurm version submissions go to; ``None``: none does (a local run).
VersionProbe = Callable[[], "SlurmVersion | None"]


@functools.cache
def installed_slurm_version() -> SlurmVersion:
    """The version of the Slurm on this machine (``sbatch --version``), asked once per
    process (a request and the script it renders both need it).

    Raises:
        SlurmError: no sbatch, no Slurm configuration, or unreadable output.
    """
    from slurm_elastic.slurm.commands import SlurmClient

    return SlurmClient(timeout_s=30.0).version()


def requeue_option(expedite: bool, slurm_version: VersionProbe | None = None) -> str:
    """The sbatch requeue option: ``--requeue``, or ``--requeue=expedite`` when asked for
    and the Slurm in use supports it.

    Args:
        expedite: the template key ``expedited_requeue``.
        slurm_version: the probe (default :func:`installed_slurm_version`); asked only
            when ``expedite`` is true. A probe returning ``None`` means no Slurm is
            involved (a local run): nothing to check, ``--requeue`` is returned.

    Raises:
        ConfigError: ``expedite`` on a Slurm older than 25.11, or on a machine where the
            version cannot be read; the message names the version (or the failure) and the fix.
    """
    if not expedite:
        return "--requeue"
    probe = installed_slurm_version if slurm_version is None else slurm_version
    try:
        version = probe()
    except SlurmError as exc:
        raise ConfigError(
            f"template value 'expedited_requeue' = true: cannot tell whether this Slurm "
            f"supports --requeue=expedite (Slurm >= {EXPEDITED_REQUEUE_SINCE.major}."
            f"{EXPEDITED_REQUEUE_SINCE.minor:02d}): 'sbatch --version' failed ({exc}); "
            "render on a machine where sbatch works (SLURM_CONF set), or drop "
            "expedited_requeue"
        ) from exc
    if version is None:
        return "--requeue"
    if version < EXPEDITED_REQUEUE_SINCE:
        raise ConfigError(
            f"template value 'expedited_requeue' = true needs Slurm >= "
            f"{EXPEDITED_REQUEUE_SINCE.major}.{EXPEDITED_REQUEUE_SINCE.minor:02d} "
            f"(sbatch --requeue=expedite), but the Slurm here is {version} "
            "('sbatch --version'); drop expedited_requeue (or set it to false): the job "
            "keeps --requeue, and slurm_elastic still requeues preempted tasks itself; "
            "or ask the site to upgrade Slurm"
        )
    return "--requeue=expedite"
