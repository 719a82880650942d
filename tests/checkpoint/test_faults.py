"""Issue #10: each defect reproduced against real files and real processes, then fixed.

Faults are real: SIGKILL at chosen points of the write path (the ``_faults`` seam blocks a
child process there), a file-size limit (``RLIMIT_FSIZE`` with ``SIGXFSZ`` at its default
action) killing a writer mid-write, and a small tmpfs (mounted here, as root) for ENOSPC.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from slurm_elastic.checkpoint.manager import CheckpointManager
from slurm_elastic.checkpoint.manifest import verify_checkpoint
from slurm_elastic.errors import CheckpointError, CheckpointWriteError
from tests.helpers import wait_for

# ---------------------------------------------------------------- 1. staging keys


def _distinct(seed: int) -> torch.Tensor:
    return torch.full((64,), float(seed))


@pytest.mark.parametrize(
    "state",
    [
        {1: _distinct(1), "1": _distinct(2)},
        {"a/b": _distinct(3), "a": {"b": _distinct(4)}},
        {"state": {0: {"m": _distinct(5)}, "0": {"m": _distinct(6)}}},
        {"x": [_distinct(7)], "y": {0: _distinct(8)}, "z": (_distinct(9),)},
    ],
    ids=["int_vs_str", "slash_vs_nested", "optimizer_like", "list_vs_dict"],
)
def test_async_save_keeps_every_tensor_distinct_whatever_the_keys(
    tmp_path: Path, state: dict[object, object]
) -> None:
    mgr = CheckpointManager(tmp_path)
    for step in (1, 2):  # the second save reuses the staging buffers
        mgr.save(state, step, blocking=False)
        mgr.flush()
        loaded = mgr.load(step)
        assert repr(loaded.state) == repr(state)
    mgr.close()


# ---------------------------------------------------------------- 2. the step number


@pytest.mark.parametrize("step", [5.0, True, "5", torch.tensor(5.0), torch.tensor([5]), -1])
@pytest.mark.parametrize("blocking", [True, False])
def test_a_non_integral_step_is_refused_before_anything_is_written(
    tmp_path: Path, step: object, blocking: bool
) -> None:
    mgr = CheckpointManager(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"step=.*(integer|>= 0)"):
        mgr.save({"w": torch.ones(4)}, step, blocking=blocking)  # type: ignore[arg-type]
    mgr.flush()
    assert not (tmp_path / "ckpt").exists() or os.listdir(tmp_path / "ckpt") == []


@pytest.mark.parametrize(
    "step", [np.int64(5), np.int32(5), torch.tensor(5), torch.tensor(5, dtype=torch.int32)]
)
def test_numpy_and_0d_tensor_integer_steps_are_accepted(tmp_path: Path, step: object) -> None:
    mgr = CheckpointManager(tmp_path)
    assert mgr.save({"w": torch.ones(4)}, step) == tmp_path / "step_5"  # type: ignore[arg-type]
    mgr.save({"w": torch.ones(4)}, step, blocking=False)  # type: ignore[arg-type]
    mgr.flush()
    loaded = mgr.load_latest()
    assert loaded is not None and loaded.step == 5 and type(loaded.step) is int
    assert loaded.manifest.step == 5


@pytest.mark.parametrize(
    "metadata",
    [{"loss": torch.tensor(1.0)}, {"epoch": np.int64(1)}, {"f": print}, {1: "int key"}],
)
def test_metadata_that_json_cannot_hold_is_refused_before_writing(
    tmp_path: Path, metadata: dict[object, object]
) -> None:
    mgr = CheckpointManager(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="metadata"):
        mgr.save({"w": torch.ones(4)}, 1, metadata=metadata)  # type: ignore[arg-type]
    assert not (tmp_path / "ckpt").exists() or os.listdir(tmp_path / "ckpt") == []


# ---------------------------------------------------------------- 5. the manifest


def _two_checkpoints(directory: Path) -> tuple[CheckpointManager, Path, bytes]:
    mgr = CheckpointManager(directory, keep_last=None)
    mgr.save({"w": torch.ones(8)}, 1, metadata={"epoch": 0})
    mgr.save({"w": torch.zeros(8)}, 2, metadata={"epoch": 1})
    manifest = directory / "step_2" / "manifest.json"
    return mgr, manifest, manifest.read_bytes()


@pytest.mark.parametrize("xor", [0x01, 0x20, 0x80])
def test_any_changed_manifest_byte_is_skipped_with_a_warning_never_raised(
    tmp_path: Path, xor: int, caplog: pytest.LogCaptureFixture
) -> None:
    mgr, manifest, original = _two_checkpoints(tmp_path)
    missed = []
    for i in range(len(original)):
        damaged = bytearray(original)
        damaged[i] ^= xor
        manifest.write_bytes(bytes(damaged))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="slurm_elastic.checkpoint"):
            loaded = mgr.load_latest()  # must never raise
        if loaded is None or loaded.step != 1 or "step_2" not in caplog.text:
            missed.append((i, chr(original[i]), loaded.step if loaded else None))
    assert not missed, f"byte changes not detected (offset, byte, loaded): {missed[:10]}"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("step", 3),
        ("world_size", 4),
        ("metadata", {"epoch": 7}),
        ("kind", "sharded"),
        ("created", 1.0),
        ("format_version", 1),
        ("files", []),
    ],
)
def test_every_manifest_field_is_covered(
    tmp_path: Path, field: str, value: object, caplog: pytest.LogCaptureFixture
) -> None:
    mgr, manifest, original = _two_checkpoints(tmp_path)
    raw = json.loads(original)
    raw[field] = value  # a valid JSON manifest with one field changed
    manifest.write_text(json.dumps(raw, indent=1, sort_keys=True))
    with caplog.at_level(logging.WARNING, logger="slurm_elastic.checkpoint"):
        loaded = mgr.load_latest()
    assert loaded is not None and loaded.step == 1
    assert "step_2" in caplog.text and "manifest" in caplog.text


# ---------------------------------------------------------------- 4, 6: SIGKILL at a point

CHILD = Path(__file__).with_name("save_child.py")


def kill_child_at(directory: Path, point: str, mode: str, tmp_path: Path) -> None:
    """Run save_child.py until it blocks at ``point``, then SIGKILL it there."""
    marker = tmp_path / f"reached-{point}-{mode}"
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(directory), point, mode, str(marker)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
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


def child_state(step: int) -> torch.Tensor:
    return torch.randn(2048, 1024, generator=torch.Generator().manual_seed(step))


def test_resave_killed_between_the_two_renames_recovers_the_complete_copy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "ckpt"
    kill_child_at(directory, "between_renames", "resave", tmp_path)
    assert not (directory / "step_2").exists()  # the crash window: step 2 is invisible
    mgr = CheckpointManager(directory)
    with caplog.at_level(logging.WARNING, logger="slurm_elastic.checkpoint"):
        loaded = mgr.load_latest()
    assert loaded is not None and loaded.step == 2, "step 2 was lost"
    assert torch.equal(loaded.state["w"], child_state(2))
    assert "recover" in caplog.text
    mgr.save({"w": torch.ones(4)}, 3)  # the next save does not delete it either
    assert [i.step for i in mgr.list_checkpoints()] == [1, 2, 3]
    assert mgr.incomplete() == []


def test_kill_during_a_retention_delete_never_lists_a_partial_checkpoint(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    kill_child_at(directory, "mid_retention", "retention", tmp_path)
    mgr = CheckpointManager(directory, keep_last=1)
    infos = mgr.list_checkpoints()
    assert [i.step for i in infos] == [2]
    for info in infos:
        verify_checkpoint(info.path)  # every listed checkpoint is complete
    mgr.save({"w": torch.ones(4)}, 3)  # and the half-deleted leftover is cleaned up
    assert sorted(os.listdir(directory)) == ["step_3"]


# ---------------------------------------------------------------- 3. a full disk


def test_a_save_killed_mid_write_does_not_keep_the_disk_full(
    small_fs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer dies mid-write (RLIMIT_FSIZE, SIGXFSZ at its default action) and leaves a
    5 MiB temporary on an 8 MiB filesystem; the next save must still fit."""
    directory = small_fs / "ckpt"
    child = subprocess.run(
        [sys.executable, str(CHILD), str(directory), "-", "fsize", str(tmp_path / "m")],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == -signal.SIGXFSZ, child.stderr
    mgr = CheckpointManager(directory)
    (leftover,) = mgr.incomplete()
    assert leftover.name.startswith(".tmp-step_2")
    state = {"w": torch.randn(6 << 18)}  # 6 MiB: fits only once the leftover is gone
    with caplog.at_level(logging.WARNING, logger="slurm_elastic.checkpoint"):
        assert mgr.save(state, 2) == directory / "step_2"
    assert str(leftover) in caplog.text and not leftover.exists()
    loaded = mgr.load_latest()
    assert loaded is not None and loaded.step == 2 and torch.equal(loaded.state["w"], state["w"])


def test_enospc_message_names_the_temporary_and_no_useless_fix(small_fs: Path) -> None:
    mgr = CheckpointManager(small_fs / "ckpt", keep_last=1)
    mgr.save({"w": torch.zeros(1 << 18)}, 1)  # 1 MiB
    with pytest.raises(CheckpointWriteError) as info:
        mgr.save({"w": torch.zeros(2 << 20)}, 2)  # 8 MiB
    message = str(info.value)
    assert "no space left" in message and ".tmp-step_2" in message
    assert "keep_last" not in message  # retention runs after a save: it cannot help here
    assert "bytes are free" in message
    assert mgr.incomplete() == [] and [i.step for i in mgr.list_checkpoints()] == [1]
