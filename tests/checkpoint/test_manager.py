"""CheckpointManager: atomic commit, verification, retention, clear errors, async save.

Real files, real processes (SIGKILL), real tmpfs mounts for ENOSPC / read-only.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from slurm_elastic.checkpoint import _faults
from slurm_elastic.checkpoint.manager import (
    CheckpointFlushTimeout,
    CheckpointManager,
)
from slurm_elastic.checkpoint.manifest import verify_checkpoint
from slurm_elastic.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWriteError,
    UnsupportedStateError,
)
from tests.helpers import wait_for

CHILD = Path(__file__).with_name("save_child.py")


@pytest.fixture
def fault_hook() -> Iterator[Callable[[Callable[[str], None]], None]]:
    """Install a hook at the checkpoint code's crash points (the ``_faults`` test seam)."""
    yield lambda hook: _faults.install(hook)
    _faults.install(None)


def state_for(step: int, rows: int = 256) -> dict[str, object]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(rows, 1024, generator=gen), "step": step}


def assert_state(loaded: object, step: int, rows: int = 256) -> None:
    expected = state_for(step, rows)
    assert isinstance(loaded, dict)
    assert loaded["step"] == step
    assert torch.equal(loaded["w"], expected["w"])


# ---------------------------------------------------------------- basics / retention


def test_save_then_load_latest_roundtrips_the_newest(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=None)
    assert mgr.load_latest() is None  # first run: nothing to resume
    for step in (1, 2, 3):
        path = mgr.save(state_for(step), step, metadata={"epoch": 0})
        assert path == tmp_path / f"step_{step}"
    loaded = mgr.load_latest()
    assert loaded is not None and loaded.step == 3
    assert_state(loaded.state, 3)
    assert loaded.manifest.metadata == {"epoch": 0}
    assert loaded.manifest.world_size == 1
    assert [i.step for i in mgr.list_checkpoints()] == [1, 2, 3]


def test_retention_keeps_last_k_and_every_mth(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2, keep_every=4)
    for step in range(1, 10):
        mgr.save({"step": step}, step)
    assert [i.step for i in mgr.list_checkpoints()] == [4, 8, 9]


def test_retention_never_deletes_the_checkpoint_just_written_when_newer_ones_are_damaged(
    tmp_path: Path,
) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(state_for(10), 10)
    (tmp_path / "step_10" / "state.bin").write_bytes(b"garbage")  # newest is now damaged
    mgr.save(state_for(5), 5)  # resumed from an older one and saved again
    assert {i.step for i in mgr.list_checkpoints()} == {5, 10}  # 10 kept (newer), never loaded
    loaded = mgr.load_latest()
    assert loaded is not None and loaded.step == 5


def test_saving_an_existing_step_replaces_it(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(state_for(1), 7)
    mgr.save(state_for(2), 7)
    loaded = mgr.load(7)
    assert torch.equal(loaded.state["w"], state_for(2)["w"])
    assert mgr.incomplete() == []


def test_non_zero_rank_does_not_write(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, rank=1)
    assert mgr.save(state_for(1), 1) is None
    assert mgr.list_checkpoints() == []


def test_bad_retention_settings_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="keep_last=0"):
        CheckpointManager(tmp_path, keep_last=0)


def test_from_env_uses_the_agent_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_ELASTIC_CHECKPOINT_DIR", str(tmp_path / "x"))
    assert CheckpointManager.from_env().directory == tmp_path / "x"
    monkeypatch.delenv("SLURM_ELASTIC_CHECKPOINT_DIR")
    with pytest.raises(CheckpointError, match="SLURM_ELASTIC_CHECKPOINT_DIR"):
        CheckpointManager.from_env()


# ---------------------------------------------------------------- corruption


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest", "bad_manifest"])
def test_damaged_newest_checkpoint_is_skipped_with_a_warning(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=None)
    mgr.save(state_for(1), 1)
    mgr.save(state_for(2), 2)
    newest = tmp_path / "step_2"
    data = newest / "state.bin"
    if damage == "truncate":
        os.truncate(data, data.stat().st_size // 2)
    elif damage == "flip":
        with open(data, "r+b") as fh:
            fh.seek(data.stat().st_size - 4096)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "no_manifest":
        (newest / "manifest.json").unlink()
    else:
        (newest / "manifest.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="slurm_elastic.checkpoint"):
        loaded = mgr.load_latest()
    assert loaded is not None and loaded.step == 1
    assert_state(loaded.state, 1)
    assert any(str(newest) in r.getMessage() for r in caplog.records), caplog.text
    assert newest.exists()  # never deleted silently
    with pytest.raises(CheckpointCorruptError, match="step_2"):
        mgr.load(2)


# ---------------------------------------------------------------- kill -9 mid-save


@pytest.mark.parametrize(
    ("point", "mode"),
    [
        ("after_mkdir", "sync"),
        ("mid_data", "sync"),
        ("before_manifest", "sync"),
        ("before_commit", "sync"),
        ("mid_data", "async"),
        ("before_commit", "async"),
    ],
)
def test_sigkill_during_save_leaves_previous_checkpoint_loadable(
    tmp_path: Path, point: str, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "ckpt"
    marker = tmp_path / "reached"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(directory), point, mode, str(marker)], env=env
    )
    try:
        wait_for(lambda: marker.exists() or child.poll() is not None, 120, f"child at {point}")
        assert child.poll() is None, f"child exited early with {child.returncode}"
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=60)
    mgr = CheckpointManager(directory)
    leftovers = mgr.incomplete()
    assert len(leftovers) == 1  # the partial save is still there, not deleted...
    with caplog.at_level(logging.WARNING, logger="slurm_elastic.checkpoint"):
        loaded = mgr.load_latest()
    assert loaded is not None and loaded.step == 1  # ...and never loaded
    assert_state(loaded.state, 1, rows=2048)
    assert [i.step for i in mgr.list_checkpoints()] == [1]
    assert str(leftovers[0]) in caplog.text
    # The next successful save cleans the leftover up, loudly.
    with caplog.at_level(logging.WARNING, logger="slurm_elastic.checkpoint"):
        mgr.save(state_for(3), 3)
    assert mgr.incomplete() == []
    assert "interrupted checkpoint save" in caplog.text


def test_sigkill_after_commit_keeps_the_new_checkpoint(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    marker = tmp_path / "reached"
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(directory), "after_commit", "sync", str(marker)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        wait_for(lambda: marker.exists() or child.poll() is not None, 120, "child at commit")
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    loaded = CheckpointManager(directory).load_latest()
    assert loaded is not None and loaded.step == 2
    verify_checkpoint(loaded.path)


# ---------------------------------------------------------------- ENOSPC / read-only


def test_enospc_raises_a_clear_error_and_keeps_the_previous_checkpoint(small_fs: Path) -> None:
    mgr = CheckpointManager(small_fs / "ckpt")
    mgr.save(state_for(1, rows=256), 1)  # 1 MiB fits
    with pytest.raises(CheckpointWriteError, match=r"ckpt/\.tmp-step_2.*no space left"):
        mgr.save(state_for(2, rows=2048), 2)  # 8 MiB does not
    assert mgr.incomplete() == []  # our own partial write was removed
    loaded = mgr.load_latest()
    assert loaded is not None and loaded.step == 1
    assert_state(loaded.state, 1)


def test_async_enospc_is_raised_by_flush(small_fs: Path) -> None:
    mgr = CheckpointManager(small_fs / "ckpt")
    mgr.save(state_for(1, rows=256), 1)
    mgr.save(state_for(2, rows=2048), 2, blocking=False)
    with pytest.raises(CheckpointWriteError, match="no space left"):
        mgr.flush()
    mgr.flush()  # raised once; the manager is usable again
    loaded = mgr.load_latest()
    assert loaded is not None and loaded.step == 1


def test_read_only_filesystem_raises_a_clear_error_and_previous_loads(small_fs: Path) -> None:
    mgr = CheckpointManager(small_fs / "ckpt")
    mgr.save(state_for(1), 1)
    res = subprocess.run(
        ["mount", "-o", "remount,ro", str(small_fs)], capture_output=True, text=True, timeout=30
    )
    if res.returncode != 0:
        pytest.skip(reason=f"cannot remount read-only: {res.stderr.strip()}")
    with pytest.raises(CheckpointWriteError, match=r"read-only.*ckpt"):
        mgr.save(state_for(2), 2)
    loaded = mgr.load_latest()
    assert loaded is not None and loaded.step == 1
    assert_state(loaded.state, 1)


def test_unserializable_state_is_a_write_error(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(state_for(1), 1)
    # by default: refused as not storable in the pickle-free format, naming the value
    with pytest.raises(UnsupportedStateError, match=r"state\['fn'\]: a builtins.function"):
        mgr.save({"fn": lambda: None}, 2)
    # weights_only=False is about reading old state.pt files: saving refuses the same
    with pytest.raises(UnsupportedStateError, match=r"state\['fn'\]: a builtins.function"):
        CheckpointManager(tmp_path, weights_only=False).save({"fn": lambda: None}, 2)
    assert mgr.incomplete() == []
    assert [i.step for i in mgr.list_checkpoints()] == [1]


# ---------------------------------------------------------------- async


def test_async_save_returns_while_writing_and_flush_waits(
    tmp_path: Path, fault_hook: Callable[[Callable[[str], None]], None]
) -> None:
    reached = threading.Event()
    release = threading.Event()

    def hook(point: str) -> None:
        if point == "mid_data":
            reached.set()
            release.wait(timeout=120)

    fault_hook(hook)
    mgr = CheckpointManager(tmp_path)
    state = state_for(1, rows=1024)
    expected = state["w"].clone()
    assert mgr.save(state, 1, blocking=False) is None  # returned: only staging blocked
    wait_for(reached.is_set, 60, "background writer mid-data")
    assert mgr.in_flight
    state["w"].mul_(0)  # training continues and mutates the live tensors
    with pytest.raises(CheckpointFlushTimeout, match="still in flight"):
        mgr.flush(timeout=0.1)
    assert mgr.list_checkpoints() == []  # nothing visible before the commit
    release.set()
    assert mgr.flush(timeout=120) == tmp_path / "step_1"
    assert not mgr.in_flight
    loaded = mgr.load_latest()
    assert loaded is not None
    assert torch.equal(loaded.state["w"], expected)  # the state as of save(), not later
    mgr.close()


def test_second_async_save_waits_for_the_first(
    tmp_path: Path, fault_hook: Callable[[Callable[[str], None]], None]
) -> None:
    order: list[str] = []
    fault_hook(order.append)
    mgr = CheckpointManager(tmp_path, keep_last=None)
    mgr.save(state_for(1), 1, blocking=False)
    mgr.save(state_for(2), 2, blocking=False)
    mgr.flush()
    commits = [p for p in order if p == "after_commit"]
    assert len(commits) == 2
    # The whole first write path ran before the second began: at most one in flight.
    mkdirs = [i for i, point in enumerate(order) if point == "after_mkdir"]
    assert order.index("after_commit") < mkdirs[1]
    assert [i.step for i in mgr.list_checkpoints()] == [1, 2]
    mgr.close()
