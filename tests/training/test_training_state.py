"""One training-state model: the layout checkpoints and in-place commits share, and the
check that refuses a state that does not fit before anything is replaced."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slurm_elastic.checkpoint import CheckpointManager, restore_training_state, training_state
from slurm_elastic.checkpoint.bundle import restore_state, state_bundle
from slurm_elastic.errors import CheckpointMismatchError, StateExchangeError
from slurm_elastic.live import ElasticState
from slurm_elastic.training import TrainingState


def _objects(width: int = 3) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1)


def test_a_commit_and_a_checkpoint_have_one_layout() -> None:
    model, opt, sched = _objects()
    scaler = torch.amp.GradScaler("cpu")
    state = ElasticState(
        model, opt, sched, stateful={"scaler": scaler}, step=4, epoch=1, sample_offset=20
    )
    commit = state.snapshot()
    bundle = training_state(
        model, opt, sched, step=4, epoch=1, sample_offset=20, global_batch_size=5,
        stateful={"scaler": scaler},
    )  # fmt: skip
    assert set(bundle) - set(commit) == {"rng", "extra"}
    assert set(commit) == state.parts() == {"model", "optimizer", "scheduler", "stateful",
                                            "progress"}  # fmt: skip
    assert commit["progress"] == {"step": 4, "epoch": 1, "sample_offset": 20}
    assert bundle["progress"] == {**commit["progress"], "world_size": 1, "global_batch_size": 5}
    assert state_bundle(state, global_batch_size=5).keys() == bundle.keys()
    # a checkpoint of the session's state restores into a plain TrainingState and back
    fresh_model, fresh_opt, fresh_sched = _objects()
    with torch.no_grad():
        fresh_model[0].weight.zero_()
    fresh = TrainingState(fresh_model, fresh_opt, fresh_sched,
                          stateful={"scaler": torch.amp.GradScaler("cpu")},
                          step=0, epoch=0, sample_offset=0)  # fmt: skip
    info = restore_state(bundle, fresh, source="bundle")
    assert fresh.progress == commit["progress"] and info.global_batch_size == 5
    assert torch.equal(fresh_model[0].weight, model[0].weight)


def test_a_checkpoint_that_does_not_fit_changes_nothing(tmp_path: object) -> None:
    """Before one check: the model was loaded first, and an optimizer state of the wrong
    shape then went in silently (torch's load_state_dict does not compare shapes)."""
    model, opt, sched = _objects()
    bundle = training_state(model, opt, sched, step=1)
    first = next(iter(bundle["optimizer"]["state"]))
    bundle["optimizer"]["state"][first]["exp_avg"] = torch.zeros(7, 7)
    other, other_opt, other_sched = _objects()
    with torch.no_grad():
        other[0].weight.fill_(0.5)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match=r"optimizer.state\[0\]\['exp_avg'\]"):
        restore_training_state(bundle, other, other_opt, other_sched, source="ckpt-x")
    assert all(torch.equal(other.state_dict()[k], v) for k, v in before.items())
    assert other_opt.state[other[0].weight]["exp_avg"].shape == (3, 4)


def test_a_missing_part_names_the_checkpoint_and_the_fix() -> None:
    model, opt, _ = _objects()
    bundle = training_state(model, None, None, step=1)
    with pytest.raises(CheckpointMismatchError, match=r"ckpt-y holds no state for \['optimizer"):
        restore_training_state(bundle, model, opt, source="ckpt-y")


def test_a_peer_state_is_checked_exactly_and_a_checkpoint_leniently() -> None:
    """A peer runs the same code: progress and scheduler keys must be equal. A checkpoint
    may come from an older torch: a scheduler key more or less is its load's business."""
    model, opt, sched = _objects()
    state = TrainingState(model, opt, sched, step=0, epoch=0, sample_offset=0)
    tree = state.state_dict()
    tree["scheduler"]["added_by_a_newer_torch"] = 1
    tree["progress"]["world_size"] = 2

    def refuse(where: str, why: str) -> Exception:
        return StateExchangeError(f"{where}: {why}")

    state.check(tree, refuse, exact=False)
    with pytest.raises(StateExchangeError, match="progress"):
        state.check(tree, refuse)
    del tree["progress"]["world_size"]
    with pytest.raises(StateExchangeError, match="scheduler"):
        state.check(tree, refuse)


def test_a_stateful_object_without_the_protocol_is_refused_at_registration() -> None:
    model, _, _ = _objects()
    with pytest.raises(TypeError, match=r"stateful\['lr'\] is a float"):
        TrainingState(model, stateful={"lr": 0.1})


def test_a_state_the_format_cannot_hold_is_refused_at_save(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """One format for replicated state: a custom object is refused (naming it and the
    fix) instead of being pickled into a checkpoint no default reader can load."""

    class Opaque:
        pass

    mgr = CheckpointManager(tmp_path, run_id="")
    mgr.save({"w": torch.ones(2)}, 1)
    for blocking in (True, False):
        with pytest.raises(
            Exception, match=r"state\['obj'\]: a .*Opaque.*never holds a pickle"
        ) as info:
            mgr.save({"w": torch.ones(2), "obj": Opaque()}, 2, blocking=blocking)
        assert type(info.value).__name__ == "UnsupportedStateError"
        mgr.flush()
    assert [c.step for c in mgr.list_checkpoints()] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
