"""What one local node of ``cluster="local"`` runs: resolve the config, run its agent.

The config is resolved **on the node** (``load_config(environ=<the node's env>,
overrides=<what the user set>)``), not at submission time. :func:`run_spec` reads the
node's arguments from a JSON spec; its program entry is ``python -m
slurm_elastic.cli.node SPEC.json`` (program entries, which configure logging, live in
:mod:`slurm_elastic.cli`). A Slurm task runs the rendered template instead, which
exports the config and ``exec``-s ``slurm-elastic agent``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

__all__ = ["run_spec"]

log = logging.getLogger(__name__)


def run_spec(spec_path: str | os.PathLike[str]) -> int:
    """Run one local node from its JSON spec (written by :mod:`slurm_elastic.submit.local`).

    Returns:
        The agent's exit code.
    """
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    from slurm_elastic.agent import warm_workers
    from slurm_elastic.config import load_config

    config = load_config(None, environ=os.environ, overrides=spec["overrides"])
    # before this process imports torch
    warm = warm_workers.start(config, os.environ, spec["entrypoint"], spec["args"], spec["module"])
    try:
        from slurm_elastic.agent import run_agent

        return int(
            run_agent(config, spec["entrypoint"], spec["args"], module=spec["module"], warm=warm)
        )
    finally:
        if warm is not None:
            warm.close()
