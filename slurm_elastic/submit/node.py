"""What every submitted task runs: resolve the config on the node, then run its agent.

The config is resolved **on the node** (``load_config(environ=<the node's env>,
overrides=<what the user set>)``), not at submission time: the run id, the node's
address and the GPU count come from the node's Slurm environment.

Used two ways:

* :func:`run_node` is the function submitit pickles for each Slurm task;
* :func:`run_spec` is one local "node" of ``cluster="local"`` (the spec holds the same
  arguments as JSON); its program entry is ``python -m slurm_elastic.cli.node SPEC.json``
  (program entries, which configure logging, live in :mod:`slurm_elastic.cli`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from slurm_elastic import signals
from slurm_elastic.errors import AgentError
from slurm_elastic.exit_codes import describe, is_run_ok

__all__ = ["run_node", "run_spec"]

log = logging.getLogger(__name__)


def _reset_submitit_signals() -> None:
    """Undo submitit's job-side handlers before anything slow runs; hold notices.

    submitit answers SIGTERM with "bypass" and the preempt signal with its own
    checkpoint-and-requeue of the whole job; our agent requeues only its own task and
    needs SIGTERM to stop its workers. From here until ``run_agent`` installs its
    handlers, a notice (USR1/USR2) is held (:func:`~slurm_elastic.signals.hold_early_notices`)
    and handed to the agent, which acts on it as soon as it can (it was only recorded in
    a flag nobody read before).
    """
    if os.environ.get("SUBMITIT_EXECUTOR") is None:
        return
    for sig in (signal.SIGTERM, signal.SIGCONT):
        signal.signal(sig, signal.SIG_DFL)
    signals.hold_early_notices()


def run_node(
    overrides: Mapping[str, Any],
    entrypoint: str,
    args: Sequence[str] = (),
    module: bool = False,
) -> int:
    """Resolve this node's config and run its agent (the body of every submitted task).

    Args:
        overrides: the config keys the user set (highest precedence).
        entrypoint: the training script (or module with ``module=True``).
        args: its arguments.
        module: run ``python -m entrypoint``.

    Returns:
        The agent's exit code when it is not a failure (0 finished, 3 preempted and
        requeued).

    Raises:
        AgentError: the agent exited with another code, so that Slurm and submitit
            record the task as failed.
    """
    from slurm_elastic.agent import run_agent
    from slurm_elastic.config import load_config

    _reset_submitit_signals()  # first: submitit's own handlers must not act on a notice
    config = load_config(None, environ=os.environ, overrides=overrides)
    code = int(run_agent(config, entrypoint, list(args), module=module))
    if not is_run_ok(code):
        raise AgentError(
            f"the node agent exited with {code} ({describe(code)}); see the agent log above "
            "and the run's events (events_dir)"
        )
    return code


def run_spec(spec_path: str | os.PathLike[str]) -> int:
    """Run one local node from its JSON spec (written by :mod:`slurm_elastic.submit.local`).

    Returns:
        The agent's exit code.
    """
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    from slurm_elastic.agent import run_agent
    from slurm_elastic.config import load_config

    config = load_config(None, environ=os.environ, overrides=spec["overrides"])
    return int(run_agent(config, spec["entrypoint"], spec["args"], module=spec["module"]))
