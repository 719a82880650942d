"""Fault-matrix collection: runs in every suite; the slurmctld restart runs last.

The matrix (in place, the example's default path) took 9 of the full suite's 33 minutes
on this 2-core machine. ``SLURM_ELASTIC_FAULTS=0`` skips its Slurm and slow cases for a
quicker local run; the quick ones still run, and so do the short Slurm cases of
:data:`DEFAULT_SUITE` (short jobs that end by themselves). Four cases of the restart-path column run in every
suite (``test_array_faults.RESTART_CASES``); the whole column of docs/reliability.md is
``python bench/fault_matrix.py`` (``FAULTS_PATH=restart``).

Restarting the controller briefly disturbs every other job on the shared test cluster
(their Slurm commands retry), so it goes after everything else, never in between.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

OPT_OUT = "SLURM_ELASTIC_FAULTS"
HERE = Path(__file__).resolve().parent
# Read once, then removed from this process' environment: the jobs the matrix submits
# inherit it (sbatch exports the environment), and an agent refuses an unknown
# SLURM_ELASTIC_* variable (exit 2: a typo in a config key must not pass silently).
SKIPPED = os.environ.pop(OPT_OUT, None) == "0"
#: Slurm cases that run even with the matrix skipped: a job refused at once, a job
#: failing at once.
DEFAULT_SUITE = frozenset(
    {
        "test_a_second_job_with_the_same_run_id_is_refused_clearly",
        "test_malformed_value_inside_a_job_fails_fast_and_clearly",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if SKIPPED:
        why = f"fault matrix skipped ({OPT_OUT}=0)"
        skip = pytest.mark.skip(reason=why)
        for item in items:
            # This hook sees every item of the session: only this directory's are skipped.
            mine = HERE in Path(item.path).parents
            if getattr(item, "originalname", item.name) in DEFAULT_SUITE:
                continue
            if mine and (item.get_closest_marker("slurm") or item.get_closest_marker("slow")):
                item.add_marker(skip)
        return
    last = [i for i in items if "test_slurmctld_restart.py" in i.nodeid]
    if last:
        rest = [i for i in items if i not in last]
        items[:] = rest + last
