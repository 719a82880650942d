"""Wiring: build a :class:`SlurmRendezvousHandler` from torch's ``RendezvousParameters``.

The one creator for every way in (torchrun's entry point, ``elastic_launch``, our agent,
direct calls): :func:`create_handler`. Registration lives in :mod:`.registration`.

The endpoint is the rendezvous *root directory* (shared filesystem); empty means
``$SLURM_SUBMIT_DIR/.slurm_elastic/rdzv`` (or ``./.slurm_elastic/rdzv`` outside Slurm).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from slurm_elastic.rendezvous.handler import SlurmRendezvousHandler
from slurm_elastic.rendezvous.options import RendezvousOptions
from slurm_elastic.rendezvous.run_directory import Incarnation, RunDirectory
from slurm_elastic.rendezvous.worker_store import resolve_local_addr

__all__ = ["create_handler", "default_root"]

log = logging.getLogger(__name__)


def default_root(environ: Mapping[str, str]) -> Path:
    """Return the default rendezvous root for ``environ``."""
    base = environ.get("SLURM_SUBMIT_DIR") or os.getcwd()
    return Path(base) / ".slurm_elastic" / "rdzv"


def create_handler(
    params: RendezvousParameters, *, environ: Mapping[str, str] | None = None
) -> SlurmRendezvousHandler:
    """Create the handler for one agent.

    Args:
        params: torch's parameters: ``endpoint`` = rendezvous root directory, ``run_id``,
            ``min_nodes``/``max_nodes``, ``local_addr``, ``config`` (string values, see
            :mod:`slurm_elastic.rendezvous.options`).
        environ: the environment to derive Slurm identities and the default address
            from (default ``os.environ``).

    Raises:
        RendezvousSetupError: the directory is unsafe or unusable.
        RendezvousClosedError: this job incarnation already closed the run.
        ConfigError: an option is malformed.
    """
    env = os.environ if environ is None else environ
    options = RendezvousOptions.from_parameters(params)
    if params.endpoint:
        root, anchor = Path(params.endpoint), None
    else:
        root = default_root(env)
        anchor = root.parent  # .slurm_elastic: must be ours, whatever the submit dir is
    run_dir = RunDirectory(
        root,
        params.run_id,
        anchor=anchor,
        liveness_window_s=options.heartbeat_interval_s * options.heartbeat_miss_limit,
    )
    incarnation = Incarnation.from_environ(env, cohort=options.cohort, key=options.incarnation)
    era = run_dir.select_era(incarnation)
    local_addr = resolve_local_addr(options.local_addr, options.interface, env)
    log.debug(
        "rendezvous %r: root %s, era %d, addr %s", params.run_id, root, era.number, local_addr
    )
    return SlurmRendezvousHandler(
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        era=era,
        incarnation=incarnation,
        local_addr=local_addr,
        options=options,
    )
