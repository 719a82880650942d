"""Fault-matrix collection: opt-in, and the slurmctld restart runs last in the session.

The matrix takes about half an hour on the 2-core CI machine, which would double the
suite's time, so it runs when asked: ``python bench/fault_matrix.py`` (which regenerates
docs/reliability.md) or ``SLURM_ELASTIC_FAULTS=1 scripts/test.sh tests/faults``.
Otherwise each Slurm or slow case is skipped with that reason; the quick ones run.

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not OPTED_IN:
        why = f"fault matrix is opt-in ({OPT_IN}=1, or python bench/fault_matrix.py)"
        skip = pytest.mark.skip(reason=why)
        for item in items:
            # This hook sees every item of the session: only this directory's are opt-in.
            mine = HERE in Path(item.path).parents
            if mine and (item.get_closest_marker("slurm") or item.get_closest_marker("slow")):
                item.add_marker(skip)
        return
    last = [i for i in items if "test_slurmctld_restart.py" in i.nodeid]
    if last:
        rest = [i for i in items if i not in last]
        items[:] = rest + last
