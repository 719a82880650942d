"""What every submitted task runs: resolve the config on the node, then run its agent.

The config is resolved **on the node** (``load_config(environ=<the node's env>,
overrides=<what the user set>)``), not at submission time: the run id, the node's
address and the GPU count come from the node's Slurm environment.

Used two ways:

* :func:`run_node` is the function submitit pickles for each Slurm task;
* ``python -m slurm_elastic.submit.node SPEC.json`` is one local "node" of
  ``cluster="local"`` (the spec holds the same arguments as JSON).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from slurm_elastic import notice
from slurm_elastic.errors import AgentError

__all__ = ["run_node"]

log = logging.getLogger(__name__)

#: ExitCode values that are not a failure of the run: finished, preempted+requeued.
_OK_CODES = (0, 3)


def _reset_submitit_signals(preempt_signal: str) -> None:
    """Undo submitit's job-side handlers before the agent installs its own.

    submitit answers SIGTERM with "bypass" and the preempt signal with its own
    checkpoint-and-requeue of the whole job; our agent requeues only its own task and
    needs SIGTERM to stop its workers. Until ``run_agent`` installs its handlers, a notice
    only sets the flag of :mod:`slurm_elastic.notice`.
    """
    if os.environ.get("SUBMITIT_EXECUTOR") is None:
        return
    for sig in (signal.SIGTERM, signal.SIGCONT):
        signal.signal(sig, signal.SIG_DFL)
    notice.install_preemption_handler(preempt_signal)


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
    from slurm_elastic.agent import ExitCode, run_agent
    from slurm_elastic.config import load_config

    config = load_config(None, environ=os.environ, overrides=overrides)
    _reset_submitit_signals(config.preempt_signal)
    code = int(run_agent(config, entrypoint, list(args), module=module))
    if code not in _OK_CODES:
        name = ExitCode(code).name if code in ExitCode._value2member_map_ else "?"
        raise AgentError(
            f"the node agent exited with {code} ({name}); see the agent log above and "
            "slurm-elastic status for the run's events"
        )
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of one local node: ``python -m slurm_elastic.submit.node SPEC.json``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m slurm_elastic.submit.node SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as fh:
        spec = json.load(fh)
    from slurm_elastic.agent import run_agent
    from slurm_elastic.config import load_config

    config = load_config(None, environ=os.environ, overrides=spec["overrides"])
    return int(run_agent(config, spec["entrypoint"], spec["args"], module=spec["module"]))


if __name__ == "__main__":
    # A program entry like the CLI: logging is configured by the CLI's one function.
    from slurm_elastic.cli.main import configure_logging

    configure_logging(0)
    sys.exit(main())
