"""The rendezvous benchmark refuses a simulation that would not fit in memory.

``bench/rendezvous.py`` simulates thousands of agents in light processes; a size that
needs more memory than the machine has does not fail, it thrashes the machine (16,384
agents on a 23 GB VM, 2026-12-06). The bench measures what each simulation used
(``sim_pss_mb``) and refuses a larger one that would not fit.
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


def test_a_size_that_fits_runs(bench: ModuleType) -> None:
    assert bench.too_big(4096, 0.5, 20_000) is None  # 3 GiB with the margin


def test_a_size_that_does_not_fit_is_refused_with_the_numbers(bench: ModuleType) -> None:
    why = bench.too_big(16_384, 1.2, 20_000)
    assert why is not None
    assert why.startswith("not run:")
    assert "28.8 GiB needed" in why and "1.20 MiB per agent" in why
    assert "19.5 GiB available" in why


def test_without_a_measurement_nothing_is_refused(bench: ModuleType) -> None:
    assert bench.too_big(16_384, None, 20_000) is None
    assert bench.too_big(16_384, 1.2, None) is None


def test_this_process_memory_is_measured(bench: ModuleType) -> None:
    pss = bench._pss_mb()
    available = bench._mem_available_mb()
    if pss is None or available is None:
        pytest.skip("this kernel has no smaps_rollup or MemAvailable")
    assert 1 < pss < available + pss  # a Python with torch imported: tens of MiB at least


def test_a_simulation_that_takes_the_memory_is_stopped(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real simulation (8 agents in a forked process); the floor is set above what
    # this machine has, as if the agents had taken it.
    available = bench._mem_available_mb()
    if available is None:
        pytest.skip("this kernel has no MemAvailable")
    monkeypatch.setattr(bench, "SIM_MEMORY_FLOOR_MB", available * 4)
    out = bench.simulate_formation(tmp_path, 8, store=False)
    assert out["ok"] is False
    assert "stopped: available memory fell to" in out["error"]
