"""ElasticSampler, world-size policy and training-state bundle (fast, in-process)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from slurm_elastic.checkpoint import (
    CheckpointManager,
    ElasticSampler,
    capture_rng,
    loss_scale,
    micro_batches,
    plan_batches,
    restore_rng,
    restore_training_state,
    training_state,
)
from slurm_elastic.errors import CheckpointError, CheckpointMismatchError
from slurm_elastic.training.sampler import rank_share


def consume(n: int, g: int, plan: list[tuple[int, int]], *, seed: int = 3) -> list[int]:
    """Consume ``steps`` steps at each ``world`` in turn; return all indices seen."""
    seen: list[int] = []
    offset = 0
    for world, steps in plan:
        samplers = [ElasticSampler(n, g, rank=r, world_size=world, seed=seed) for r in range(world)]
        for s in samplers:
            s.set_epoch(0, offset)
        per_rank = [list(s.slices())[:steps] for s in samplers]
        for rank_slices in per_rank:
            for sl in rank_slices:
                seen.extend(sl.indices)
        offset = per_rank[0][-1].stop if per_rank[0] else offset
    return seen


def test_order_depends_only_on_seed_and_epoch_and_matches_distributed_sampler() -> None:
    a = ElasticSampler(37, 5, rank=0, world_size=1, seed=11)
    b = ElasticSampler(37, 8, rank=2, world_size=3, seed=11)
    assert a.global_order(4) == b.global_order(4)
    assert a.global_order(4) != a.global_order(5)
    torch_sampler = DistributedSampler(range(37), num_replicas=1, rank=0, seed=11)
    torch_sampler.set_epoch(4)
    assert list(torch_sampler) == a.global_order(4)


@pytest.mark.parametrize("plan", [[(4, 2), (2, 3), (3, 99)], [(1, 1), (7, 1), (2, 99)], [(3, 99)]])
def test_every_sample_exactly_once_per_epoch_across_world_size_changes(
    plan: list[tuple[int, int]],
) -> None:
    seen = consume(50, 12, plan)
    assert sorted(seen) == list(range(50))


def test_shares_are_contiguous_balanced_and_may_be_empty_at_the_tail() -> None:
    assert [rank_share(0, 10, r, 3) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    tail = [ElasticSampler(50, 12, rank=r, world_size=3) for r in range(3)]
    for s in tail:
        s.set_epoch(0, 48)
    assert [len(list(s)) for s in tail] == [1, 1, 1]  # every rank gets the (last) step
    assert [len(next(iter(s))) for s in tail] == [1, 1, 0]  # ...rank 2 with no samples
    assert len(tail[0]) == 1


def test_drop_last_skips_the_short_tail_and_offset_is_validated() -> None:
    s = ElasticSampler(50, 12, rank=0, world_size=1, drop_last=True)
    assert s.epoch_length == 48 and len(s) == 4
    with pytest.raises(CheckpointError, match="sample offset 49"):
        s.set_epoch(0, 49)
    with pytest.raises(CheckpointError, match="rank=3"):
        ElasticSampler(10, 2, rank=3, world_size=2)


def test_fixed_global_plan_keeps_the_global_batch_and_accumulates() -> None:
    plan = plan_batches(3, global_batch_size=12, max_micro_batch=3)
    assert (plan.global_batch_size, plan.accumulation_steps, plan.lr_factor) == (12, 2, 1.0)
    assert plan_batches(2, global_batch_size=12).accumulation_steps == 1
    with pytest.raises(CheckpointError, match="global_batch_size=2"):
        plan_batches(4, global_batch_size=2)


def test_fixed_local_plan_scales_lr_with_the_global_batch() -> None:
    lin = plan_batches(
        4, local_batch_size=8, mode="fixed_local", lr_scaling="linear", base_world_size=2
    )
    assert (lin.global_batch_size, lin.lr_factor) == (32, 2.0)
    sq = plan_batches(
        8, local_batch_size=8, mode="fixed_local", lr_scaling="sqrt", base_world_size=2
    )
    assert sq.lr_factor == pytest.approx(2.0)


def test_micro_batches_always_yield_the_same_number_of_chunks() -> None:
    assert [list(c) for c in micro_batches([1, 2, 3, 4, 5], 2)] == [[1, 2, 3], [4, 5]]
    assert [list(c) for c in micro_batches([], 2)] == [[], []]


def test_loss_scale_makes_ddp_average_equal_the_global_mean() -> None:
    # Two ranks with uneven shares (3 and 1 of 4): DDP averages (sum_r scale * sum_i g_i).
    grads = [1.0, 2.0, 3.0, 10.0]
    scale = loss_scale(4, 2)
    ddp = (scale * sum(grads[:3]) + scale * sum(grads[3:])) / 2
    assert ddp == pytest.approx(sum(grads) / 4)


# ---------------------------------------------------------------- bundle


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: object, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
        sched.step()  # type: ignore[attr-defined]


def test_bundle_roundtrip_through_the_manager_restores_everything(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, opt, sched = make()
    train(model, opt, sched, 3)
    random.seed(5)
    np.random.seed(6)
    mgr = CheckpointManager(tmp_path)  # weights_only=True: the bundle must pass it
    mgr.save(
        training_state(
            model,
            opt,
            sched,
            step=3,
            epoch=1,
            sample_offset=24,
            global_batch_size=12,
            extra={"best": 0.5},
        ),
        3,
    )
    saved_params = {k: v.clone() for k, v in model.state_dict().items()}
    expect = (torch.rand(3), random.random(), np.random.rand())
    train(model, opt, sched, 2)  # drift away (params, optimizer, scheduler, RNG), come back
    fresh_model, fresh_opt, fresh_sched = make()
    loaded = mgr.load_latest()
    assert loaded is not None
    info = restore_training_state(
        loaded.state, fresh_model, fresh_opt, fresh_sched, source=loaded.path
    )
    assert (info.step, info.epoch, info.sample_offset, info.global_batch_size) == (3, 1, 24, 12)
    assert info.extra == {"best": 0.5} and not info.world_size_changed
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expect[0]) and got[1:] == expect[1:]
    for k, v in fresh_model.state_dict().items():
        assert torch.equal(v, saved_params[k])
    assert fresh_sched.get_last_lr() == [0.1 * 0.5**3]
    assert fresh_opt.state_dict()["state"][0]["step"] == 3
    # Same continuation: two more steps from the restored state equal two from the original.
    torch.manual_seed(9)
    train(fresh_model, fresh_opt, fresh_sched, 1)
    again = mgr.load(3)  # the optimizer took ownership of the first bundle's tensors
    restore_training_state(again.state, model, opt, sched)
    torch.manual_seed(9)
    train(model, opt, sched, 1)
    for k, v in model.state_dict().items():
        assert torch.equal(v, fresh_model.state_dict()[k])


def test_rng_capture_restore_is_exact() -> None:
    state = capture_rng()
    a = (torch.rand(4), random.random(), np.random.rand(3))
    restore_rng(state)
    b = (torch.rand(4), random.random(), np.random.rand(3))
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and np.array_equal(a[2], b[2])


def test_state_that_does_not_match_the_model_is_a_clear_error(tmp_path: Path) -> None:
    model, opt, sched = make()
    mgr = CheckpointManager(tmp_path)
    path = mgr.save(training_state(model, opt, sched, step=1), 1)
    other = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 1))
    loaded = mgr.load_latest()
    assert loaded is not None
    with pytest.raises(CheckpointMismatchError, match=rf"{path}.*does not match the model"):
        restore_training_state(loaded.state, other, source=loaded.path)
    with pytest.raises(CheckpointMismatchError, match="not a training_state"):
        restore_training_state({"w": torch.zeros(1)}, model, source=path)
    assert mgr.load(1).step == 1  # the checkpoint itself is intact
