"""The rendezvous benchmark stops a simulation that takes the machine's memory.

``bench/rendezvous.py`` simulates thousands of agents in light processes; a size that
needs more memory than the machine has does not fail, it thrashes the machine (16,384
agents on a 23 GB VM, 2026-12-06). The bench records what each simulation used
(``sim_pss_mb``) and stops one once the machine's available memory falls below
``SIM_MEMORY_FLOOR_MB``. Linux only, as the bench: both figures come from ``/proc``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "rendezvous.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_rendezvous_under_test", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_this_process_memory_and_the_machines_are_read(bench: ModuleType) -> None:
    pss = bench._pss_mb()
    available = bench._mem_available_mb()
    assert pss is not None and available is not None  # /proc has both since Linux 4.14
    assert 1 < pss < available + pss  # a Python with torch imported: tens of MiB at least


def test_a_simulation_that_takes_the_memory_is_stopped(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real simulation (8 agents in a forked process); the floor is set above what
    # this machine has, as if the agents had taken it.
    available = bench._mem_available_mb()
    assert available is not None
    monkeypatch.setattr(bench, "SIM_MEMORY_FLOOR_MB", available * 4)
    out = bench.simulate_formation(tmp_path, 8, store=False)
    assert out["ok"] is False
    assert "stopped: available memory fell to" in out["error"]


def test_a_simulation_within_the_memory_forms(bench: ModuleType, tmp_path: Path) -> None:
    out = bench.simulate_formation(tmp_path, 8, store=False)
    assert out["ok"] is True, out.get("error")
    assert out["sim_pss_mb"] > 0
