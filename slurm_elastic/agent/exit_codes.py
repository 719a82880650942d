"""Exit codes of ``slurm-elastic agent`` (defined torch-free in :mod:`slurm_elastic.exit_codes`)."""

from __future__ import annotations

from slurm_elastic.exit_codes import ExitCode

__all__ = ["ExitCode"]
