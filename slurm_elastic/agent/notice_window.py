"""The agent's start-up check of the preemption window (:mod:`slurm_elastic.slurm.window`).

At start the agent reads what warning its task gets (the job script's ``--signal`` lead
from :data:`~slurm_elastic.envvars.SIGNAL_LEAD_ENV`; ``KillWait`` and the partition's
``GraceTime`` from ``scontrol``, inside Slurm only) and how long the run's durable saves
took so far (the ``checkpoint.saved`` events of earlier runs of a requeued task), logs a
WARNING naming the setting to change when a save does not fit, and records what it read
as an ``agent.window`` event, from which ``slurm-elastic status`` judges the saves made
later. Nothing here stops the agent: a setting it cannot read is reported as unknown.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path

from slurm_elastic import events
from slurm_elastic.config import ElasticConfig
from slurm_elastic.envvars import SIGNAL_LEAD_ENV
from slurm_elastic.errors import SlurmError
from slurm_elastic.slurm.commands import SlurmClient
from slurm_elastic.slurm.env import SlurmEnv
from slurm_elastic.slurm.window import (
    NoticeWindow,
    WindowVerdict,
    plan_window,
    save_estimate,
    window_from_site,
)

__all__ = ["SITE_TIMEOUT_S", "check_notice_window", "earlier_save_durations", "signal_lead"]

log = logging.getLogger(__name__)

#: Each ``scontrol`` query at start may take this long (the agent must not hang on it).
SITE_TIMEOUT_S = 10.0


def signal_lead(environ: Mapping[str, str]) -> float | None:
    """The ``--signal`` lead the job script exported, or ``None`` (unset or not a number)."""
    text = environ.get(SIGNAL_LEAD_ENV)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        log.warning("%s=%r is not a number of seconds: ignored", SIGNAL_LEAD_ENV, text)
        return None
    return value if math.isfinite(value) and value >= 0 else None


def earlier_save_durations(events_dir: Path | None) -> list[float]:
    """The ``seconds`` of the run's ``checkpoint.saved`` events so far (oldest first)."""
    if events_dir is None or not Path(events_dir).is_dir():
        return []
    return [
        e.seconds for e in events.read_events(events_dir) if isinstance(e, events.CheckpointSaved)
    ]


def _site_window(slurm: SlurmEnv, lead: float | None, client: SlurmClient) -> NoticeWindow:
    try:
        site = client.site_config()
        partitions = client.partitions(slurm.partition)
    except SlurmError as exc:
        log.info("cannot read the site's preemption settings (%s): window partly unknown", exc)
        return NoticeWindow(signal_lead_s=lead, partition=slurm.partition)
    return window_from_site(site, partitions, slurm.partition, lead)


def check_notice_window(
    config: ElasticConfig,
    slurm: SlurmEnv,
    environ: Mapping[str, str],
    client: SlurmClient | None = None,
) -> WindowVerdict:
    """Work out the window, log the verdict (WARNING per misfit) and emit ``agent.window``.

    Args:
        config: the resolved config (``shutdown_timeout_s``, ``events_dir``).
        slurm: the Slurm environment; outside Slurm only the agent's budget is judged.
        environ: the environment (for the ``--signal`` lead).
        client: the Slurm seam (default: a :class:`SlurmClient` with short timeouts).
    """
    lead = signal_lead(environ)
    if slurm.in_slurm:
        window = _site_window(slurm, lead, client or SlurmClient(timeout_s=SITE_TIMEOUT_S))
    else:
        window = NoticeWindow(signal_lead_s=lead, preemptable=False)
    try:
        durations = earlier_save_durations(config.events_dir)
    except OSError as exc:
        log.debug("cannot read earlier saves in %s: %s", config.events_dir, exc)
        durations = []
    verdict = plan_window(window, config.shutdown_timeout_s, save_estimate(durations))
    for problem in verdict.problems():
        log.warning("%s", problem)
    log.info("%s", verdict.summary())
    events.emit(
        events.AgentWindow(
            signal_lead_s=window.signal_lead_s,
            grace_time_s=window.grace_time_s,
            kill_wait_s=window.kill_wait_s,
            partition=window.partition,
            preemptable=window.preemptable,
            shutdown_timeout_s=config.shutdown_timeout_s,
            save_s=verdict.save_s,
            fits=verdict.fits,
        )
    )
    return verdict
