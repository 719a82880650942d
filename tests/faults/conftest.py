"""Fault-matrix collection: opt-in, and the slurmctld restart runs last in the session.

The matrix takes about half an hour on the 2-core CI machine, which would double the
suite's time, so it runs when asked: ``python bench/fault_matrix.py`` (which regenerates
docs/reliability.md) or ``SLURM_ELASTIC_FAULTS=1 scripts/test.sh tests/faults``.
Otherwise each Slurm or slow case is skipped with that reason; the quick ones run, and
so do the short Slurm cases of :data:`DEFAULT_SUITE` (short jobs that end by themselves:
4 s and 27 s on a free cluster, 40-90 s while other jobs queue; all of tests/faults
without the opt-in took 55 s).

Restarting the controller briefly disturbs every other job on the shared test cluster
(their Slurm commands retry), so it goes after everything else, never in between.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

OPT_IN = "SLURM_ELASTIC_FAULTS"
HERE = Path(__file__).resolve().parent
# Read once, then removed from this process' environment: the jobs the matrix submits
# inherit it (sbatch exports the environment), and an agent refuses an unknown
# SLURM_ELASTIC_* variable (exit 2: a typo in a config key must not pass silently).
OPTED_IN = os.environ.pop(OPT_IN, None) == "1"
#: Slurm cases that run in every suite: a job refused at once, a job failing at once.
DEFAULT_SUITE = frozenset(
    {
        "test_a_second_job_with_the_same_run_id_is_refused_clearly",
        "test_malformed_value_inside_a_job_fails_fast_and_clearly",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not OPTED_IN:
        why = f"fault matrix is opt-in ({OPT_IN}=1, or python bench/fault_matrix.py)"
        skip = pytest.mark.skip(reason=why)
        for item in items:
            # This hook sees every item of the session: only this directory's are opt-in.
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
