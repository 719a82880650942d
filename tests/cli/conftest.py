"""Fixtures of the status/logs/timeline tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent.parent / "data" / "events"


@pytest.fixture(autouse=True)
def private_run_index(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """Each test gets its own run index (``$XDG_STATE_HOME``), agents started by it too."""
    xdg = tmp_path_factory.mktemp("xdg")
    monkeypatch.setenv("XDG_STATE_HOME", str(xdg))
    return xdg


@pytest.fixture
def recorded_run(tmp_path: Path) -> Path:
    """A recorded local run (3 agents, one preempted, a replacement joined; 300 steps),
    plus a torn last line and an event kind of a newer version; returns its state dir.

    The recording's paths say ``@RUN@`` for its state directory; they are rewritten here.
    """
    state = tmp_path / "state"
    shutil.copytree(DATA / "local-run", state)
    for path in state.glob("events/*/*.jsonl"):
        path.write_bytes(path.read_bytes().replace(b"@RUN@", str(state).encode()))
    return state
