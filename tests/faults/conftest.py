"""Fault-matrix collection order: the slurmctld restart runs last in the session.

Restarting the controller briefly disturbs every other job on the shared test cluster
(their Slurm commands retry), so it goes after everything else, never in between.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    last = [i for i in items if "test_slurmctld_restart.py" in i.nodeid]
    if last:
        rest = [i for i in items if i not in last]
        items[:] = rest + last
