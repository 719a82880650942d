"""The pickle-free container format (``state.bin``) and the guarded background staging.

Real files and real torch optimizers/modules. Staging is held at its ``"staging"`` point
(the ``_faults`` test seam: the copy threads block there before copying anything) so that
the training loop's next step provably runs while the copy has not been made.
"""

from __future__ import annotations

import gc
import math
import pickle
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.nn.modules.module import _global_forward_pre_hooks
from torch.optim.optimizer import _global_optimizer_pre_hooks

from slurm_elastic.checkpoint import _faults, serializer
from slurm_elastic.checkpoint.manager import CheckpointManager
from slurm_elastic.checkpoint.manifest import FileRecord, Manifest, crc32_file
from slurm_elastic.checkpoint.serializer import STATE_FILE
from slurm_elastic.checkpoint.staging import StagingConflict
from slurm_elastic.errors import (
    CheckpointError,
    CheckpointReadError,
    CheckpointWriteError,
    UnsupportedStateError,
)
from tests.checkpoint.old_format import write_torch_checkpoint
from tests.helpers import wait_for


class Held:
    """A fault hook that holds the staging threads until :meth:`release`."""

    def __init__(self) -> None:
        self.staging = threading.Event()
        self.guard = threading.Event()
        self._release = threading.Event()

    def __call__(self, point: str) -> None:
        if point == "staging":
            self.staging.set()
            self._release.wait(timeout=120)
        elif point == "guard_wait":
            self.guard.set()

    def release(self) -> None:
        self._release.set()


@pytest.fixture
def held() -> Iterator[Held]:
    hook = Held()
    _faults.install(hook)
    yield hook
    hook.release()
    _faults.install(None)


# ---------------------------------------------------------------- the format


class Opaque:
    """A value the container does not store: the save falls back to torch.save."""

    def __init__(self, x: int) -> None:
        self.x = x


def test_every_supported_value_roundtrips_without_pickle(tmp_path: Path) -> None:
    lin = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(lin.parameters())
    lin(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {
        "model": lin.state_dict(),
        "opt": opt.state_dict(),
        1: "int key",
        "1": "str key",
        "tuple": (1, 2.5, None, True),
        "bytes": b"\x00\x01",
        "complex": 1 + 2j,
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "nan": float("nan"),
        "big": 2**80,
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "bool": torch.tensor([True, False]),
        "transposed": torch.randn(4, 6).t(),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3),
        "ordered": OrderedDict(a=1),
        "rng": torch.get_rng_state(),
    }
    state["tied"] = state["model"]["weight"]
    mgr = CheckpointManager(tmp_path)
    mgr.save(state, 1)
    assert sorted(p.name for p in (tmp_path / "step_1").iterdir()) == ["manifest.json", STATE_FILE]
    for mmap in (False, True):
        loaded = mgr.load(1, mmap=mmap).state
        assert loaded.keys() == state.keys()
        for key, value in state.items():
            got = loaded[key]
            if isinstance(value, torch.Tensor):
                assert got.dtype == value.dtype and torch.equal(got, value), key
                assert got.storage_offset() == 0  # its own storage, as torch.load gives
            elif key == "nan":
                assert math.isnan(got)
            elif key not in ("model", "opt"):
                assert got == value and type(got) is type(value), key
        assert loaded["tied"] is loaded["model"]["weight"]  # tied weights stay tied
        torch.set_rng_state(loaded["rng"])  # a view into a larger storage would crash here
        fresh = torch.optim.Adam(lin.parameters())
        fresh.load_state_dict(loaded["opt"])
        lin.load_state_dict(loaded["model"])
        loaded["bf16"].add_(1)  # writable (mmap: copy-on-write, the file is unchanged)
    assert torch.equal(mgr.load(1).state["bf16"], state["bf16"])


def _mapped_files() -> set[str]:
    with open("/proc/self/maps", encoding="utf-8") as f:
        return {line.split(maxsplit=5)[5].strip() for line in f if len(line.split()) > 5}


def test_the_default_load_maps_state_bin_except_on_nfs(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save({"w": torch.arange(1 << 16, dtype=torch.float32)}, 1)
    data = str(tmp_path / "step_1" / STATE_FILE)
    assert serializer.filesystem_type(tmp_path) not in ("", "nfs", "nfs4")
    loaded = mgr.load_latest()
    assert loaded is not None and data in _mapped_files()  # mapped, not read into memory
    loaded.state["w"].add_(1)  # copy-on-write: the checkpoint is unchanged
    assert torch.equal(mgr.load(1, mmap=False).state["w"], torch.arange(1 << 16).float())
    del loaded
    gc.collect()
    assert data not in _mapped_files()
    assert serializer.filesystem_type(Path("/proc/self")) == "proc"


def test_on_nfs_the_default_load_reads_into_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Faked seam: no NFS server can be mounted here, so the filesystem type is reported
    # as NFS; everything else (save, trust checks, CRC, parse) is real.
    mgr = CheckpointManager(tmp_path)
    mgr.save({"w": torch.arange(1 << 16, dtype=torch.float32)}, 1)
    monkeypatch.setattr(serializer, "filesystem_type", lambda path: "nfs4")
    loaded = mgr.load_latest()
    assert loaded is not None and torch.equal(loaded.state["w"], torch.arange(1 << 16).float())
    # a live mapping would keep the file busy on NFS (silly rename): not mapped
    assert str(tmp_path / "step_1" / STATE_FILE) not in _mapped_files()


def test_two_formats_are_written_a_state_the_container_cannot_hold_is_refused(
    tmp_path: Path,
) -> None:
    """Earlier versions wrote it with torch.save for weights_only=False (a third format);
    now weights_only is about reading those old files only: saving refuses it either way,
    naming the value, and nothing is committed."""
    for weights_only in (True, False):
        mgr = CheckpointManager(tmp_path, weights_only=weights_only)
        with pytest.raises(UnsupportedStateError, match=r"state\['obj'\]: a .*Opaque"):
            mgr.save({"obj": Opaque(7), "w": torch.ones(2)}, 1)
    assert list(tmp_path.iterdir()) == []


def test_an_old_state_pt_with_a_custom_object_loads_with_weights_only_false(
    tmp_path: Path,
) -> None:
    write_torch_checkpoint(tmp_path, 1, {"obj": Opaque(7), "w": torch.ones(2)})
    loaded = CheckpointManager(tmp_path, weights_only=False).load(1).state
    assert loaded["obj"].x == 7 and torch.equal(loaded["w"], torch.ones(2))


def test_a_pickled_object_outside_the_weights_only_allowlist_says_so(tmp_path: Path) -> None:
    """torch.load refuses it with pickle.UnpicklingError: the type, not the message, tells
    this (the bytes verified) from a file this node cannot read."""
    write_torch_checkpoint(tmp_path, 1, {"obj": Opaque(7)})
    with pytest.raises(CheckpointError, match="weights-only allowlist") as caught:
        CheckpointManager(tmp_path).load(1)
    assert not isinstance(caught.value, CheckpointReadError)
    assert isinstance(caught.value.__cause__, pickle.UnpicklingError)


def test_checkpoints_of_the_previous_format_still_load(tmp_path: Path) -> None:
    """Earlier versions wrote one torch.save file, state.pt."""
    write_torch_checkpoint(tmp_path, 3, {"w": torch.arange(5.0), "step": 3})
    loaded = CheckpointManager(tmp_path).load_latest()
    assert loaded is not None and loaded.step == 3
    assert torch.equal(loaded.state["w"], torch.arange(5.0))


def test_a_header_that_verifies_but_is_garbage_is_skipped_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Whoever rewrote the file also fixed the manifest's CRC: the parse must not crash."""
    mgr = CheckpointManager(tmp_path, keep_last=None)
    mgr.save({"w": torch.ones(3)}, 1)
    mgr.save({"w": torch.zeros(3)}, 2)
    data = tmp_path / "step_2" / STATE_FILE
    raw = bytearray(data.read_bytes())
    raw[20:40] = b"]" * 20  # inside the JSON header
    data.write_bytes(bytes(raw))
    size, crc = crc32_file(data)
    (tmp_path / "step_2" / "manifest.json").write_text(
        Manifest(2, "replicated", 1, (FileRecord(STATE_FILE, size, crc),)).to_json()
    )
    loaded = mgr.load_latest()
    assert loaded is not None and loaded.step == 1
    assert "step_2" in caplog.text and "cannot be parsed" in caplog.text


# ---------------------------------------------------------------- guarded staging


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_equal_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_an_optimizer_step_during_staging_cannot_change_the_checkpoint(
    tmp_path: Path, held: Held
) -> None:
    model, opt = model_and_optimizer()
    model(torch.randn(4, 8)).sum().backward()
    before = snapshot(model)
    mgr = CheckpointManager(tmp_path)
    mgr.save({"model": model.state_dict()}, 1, blocking=False)
    wait_for(held.staging.is_set, 60, "the staging threads to start")
    stepper = threading.Thread(target=opt.step)
    stepper.start()
    wait_for(held.guard.is_set, 60, "optimizer.step() to reach the staging guard")
    stepper.join(timeout=60)  # the guard copies the state itself, then the step runs
    assert not stepper.is_alive()
    held.release()
    mgr.flush()
    loaded = mgr.load(1).state["model"]
    assert_equal_states(loaded, before)  # the state as of save(), not after the step
    assert not torch.equal(model[0].weight, before["0.weight"])  # the step did run
    mgr.close()


def test_a_forward_pass_during_staging_stages_the_buffers_it_changes_first(
    tmp_path: Path, held: Held
) -> None:
    model, _ = model_and_optimizer()
    model.train()
    before = snapshot(model)
    mgr = CheckpointManager(tmp_path)
    mgr.save({"model": model.state_dict()}, 1, blocking=False)
    wait_for(held.staging.is_set, 60, "the staging threads to start")
    model(torch.randn(4, 8) + 3.0)  # batch norm updates its running stats in place
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])
    held.release()
    mgr.flush()
    assert_equal_states(mgr.load(1).state["model"], before)
    mgr.close()


def test_an_unguarded_in_place_change_fails_the_save_instead_of_mixing_steps(
    tmp_path: Path, held: Held
) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save({"w": torch.zeros(4)}, 1)
    state = {"w": torch.ones(1 << 20), "n": 1}
    mgr.save(state, 2, blocking=False)
    wait_for(held.staging.is_set, 60, "the staging threads to start")
    state["w"].add_(1.0)  # not through an optimizer, no wait_staged(): unguarded
    held.release()
    with pytest.raises(StagingConflict, match=r"tensor state\['w'\] was modified in place"):
        mgr.flush()
    assert [i.step for i in mgr.list_checkpoints()] == [1]
    assert mgr.incomplete() == []
    assert isinstance(StagingConflict("x"), CheckpointWriteError)
    mgr.close()


def test_wait_staged_is_the_explicit_guard(tmp_path: Path, held: Held) -> None:
    state = {"w": torch.ones(1 << 20)}
    mgr = CheckpointManager(tmp_path)
    mgr.save(state, 1, blocking=False)
    changed = threading.Event()

    def change() -> None:
        mgr.wait_staged()
        state["w"].add_(1.0)
        changed.set()

    changer = threading.Thread(target=change)
    changer.start()
    wait_for(held.staging.is_set, 60, "the staging threads to start")
    changer.join(timeout=60)  # wait_staged() made the copy (the staging threads are held)
    assert changed.is_set()
    held.release()
    mgr.flush()
    assert torch.equal(mgr.load(1).state["w"], torch.ones(1 << 20))
    mgr.close()


def test_the_global_guards_are_removed_once_the_save_is_done(tmp_path: Path) -> None:
    before = (dict(_global_forward_pre_hooks), dict(_global_optimizer_pre_hooks))
    model, _ = model_and_optimizer()
    mgr = CheckpointManager(tmp_path)
    mgr.save({"model": model.state_dict()}, 1, blocking=False)
    mgr.flush()
    after = (dict(_global_forward_pre_hooks), dict(_global_optimizer_pre_hooks))
    assert after == before  # training runs hook-free between saves
    mgr.close()
