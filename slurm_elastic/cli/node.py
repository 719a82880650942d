"""``python -m slurm_elastic.cli.node SPEC.json``: the program of one local node.

``cluster="local"`` (:mod:`slurm_elastic.submit.local`) starts one such process per node.
A program entry like ``slurm-elastic`` itself, so it lives in the CLI package, the only
one that configures logging.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from slurm_elastic.cli.main import configure_logging
from slurm_elastic.submit.node import run_spec

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the node described by ``SPEC.json``; return the agent's exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m slurm_elastic.cli.node SPEC.json", file=sys.stderr)
        return 2
    configure_logging(0)
    return run_spec(argv[0])


if __name__ == "__main__":
    sys.exit(main())
