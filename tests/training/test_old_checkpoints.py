"""Checkpoints written by earlier versions still load with today's code.

``tests/data/checkpoints/v1`` was written by commit 1f167ef (before the training state got
one model, ``slurm_elastic.training``) with ``make_v1.py`` beside it; the files are the
bytes that code wrote, never regenerated. The sums in ``expected.json`` are those of the
state as it was saved.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from slurm_elastic.checkpoint import CheckpointManager, restore_training_state
from slurm_elastic.live import ElasticState
from slurm_elastic.live.checkpointing import resume_latest

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "checkpoints" / "v1"


def _maker():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("make_v1", GOLDEN.parent / "make_v1.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _private_copy(tmp_path: Path) -> Path:
    """The golden directory as a run's own: this user's, not writable by others (git
    checks files out with the umask's modes; the loader refuses group/other-writable)."""
    target = tmp_path / "ckpt"
    shutil.copytree(GOLDEN / "ckpt", target)
    for root, _dirs, files in os.walk(target):
        os.chmod(root, 0o700)
        for name in files:
            os.chmod(Path(root) / name, 0o600)
    return target


def test_a_checkpoint_of_the_previous_layout_loads_into_the_training_state(
    tmp_path: Path,
) -> None:
    make = _maker()
    expected = json.loads((GOLDEN / "expected.json").read_text())
    loaded = CheckpointManager(_private_copy(tmp_path), run_id="").load_latest()
    assert loaded is not None and loaded.step == 3
    assert make.sums(loaded.state) == expected  # the bytes as saved, every tensor

    model, opt, sched, stateful = make.build()
    info = restore_training_state(
        loaded.state, model, opt, sched, source=loaded.path, stateful=stateful
    )
    assert (info.step, info.epoch, info.sample_offset, info.global_batch_size) == (3, 1, 24, 8)
    assert info.extra == {"note": "v1"}
    live = make.sums(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "stateful": {name: obj.state_dict() for name, obj in stateful.items()},
        }
    )
    assert live == {k: v for k, v in expected.items() if k.split("/")[1] in
                    ("model", "optimizer", "stateful")}  # fmt: skip
    assert sched.state_dict()["last_epoch"] == 3


def test_the_session_state_resumes_from_a_checkpoint_of_the_previous_layout(
    tmp_path: Path,
) -> None:
    make = _maker()
    model, opt, sched, stateful = make.build()
    state = ElasticState(model, opt, sched, stateful=stateful, step=0, epoch=0, sample_offset=0)
    found = resume_latest(CheckpointManager(_private_copy(tmp_path), run_id=""), state)
    assert found is not None
    assert state.progress == {"step": 3, "epoch": 1, "sample_offset": 24}
    expected = json.loads((GOLDEN / "expected.json").read_text())
    for key, value in model.state_dict().items():
        assert float(value.double().sum()) == pytest.approx(expected[f"/model/{key}"], abs=0)
    assert torch.is_tensor(opt.state[next(iter(model.parameters()))]["exp_avg"])
