"""FSDP2 in the live session, in one process (world 1, a real gloo group): the config's
errors, the mesh shape, the full state round trip (gather -> new module -> shard -> load),
the peer check of a sharded state and the refusal to hand out a stale state.

The multi-node behaviour (join and graceful leave re-sharded in place, a hard loss) is
in ``test_fsdp.py``.
"""

from __future__ import annotations

import gc
import os
import socket
import weakref
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from slurm_elastic.checkpoint import exchange
from slurm_elastic.errors import StateExchangeError
from slurm_elastic.live import ElasticSession
from slurm_elastic.live.fsdp import FSDPConfig, ShardedModel, ShardsLostError, mesh_shape


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def _spec(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return exchange.TensorSpec(tree.dtype, tuple(tree.shape))
    if isinstance(tree, dict):
        return {k: _spec(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_spec(v) for v in tree]
    return tree


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    for key in [k for k in os.environ if k.startswith("SLURM_ELASTIC_")]:
        monkeypatch.delenv(key)
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_config_errors_name_the_value_and_the_rule() -> None:
    with pytest.raises(ValueError, match=r"replicate=0 must be an integer >= 1"):
        FSDPConfig(build=_net, replicate=0)
    with pytest.raises(TypeError, match=r"build=3 is not callable"):
        FSDPConfig(build=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"copy_every=-1 must be an integer >= 0 steps"):
        FSDPConfig(build=_net, copy_every=-1)


@pytest.mark.parametrize(
    ("world", "replicate", "shape"),
    [(4, 1, (1, 4)), (4, 2, (2, 2)), (2, 2, (2, 1)), (3, 2, (1, 3)), (6, 4, (2, 3))],
)
def test_mesh_shape_uses_the_largest_replica_count_that_divides_the_world(
    world: int, replicate: int, shape: tuple[int, int]
) -> None:
    assert mesh_shape(world, replicate) == shape


def test_fsdp_refuses_periodic_commits_and_a_reserved_name() -> None:
    net = _net()
    opt = torch.optim.Adam(net.parameters())
    with pytest.raises(ValueError, match=r"commit_every=2.*use commit_every=0"):
        ElasticSession(net, opt, fsdp=FSDPConfig(build=_net), dataset_size=8,
                       global_batch_size=4, commit_every=2)  # fmt: skip
    with pytest.raises(ValueError, match=r"stateful\['_fsdp'\] is reserved"):
        ElasticSession(net, opt, fsdp=FSDPConfig(build=_net), stateful={"_fsdp": opt},
                       dataset_size=8, global_batch_size=4)  # fmt: skip


def test_an_optimizer_over_other_parameters_is_refused() -> None:
    with pytest.raises(ValueError, match=r"param_groups\[0\] holds parameters \[0, 1, 2, 3\]"):
        ShardedModel(FSDPConfig(build=_net), _net(), torch.optim.SGD(_net(1).parameters()))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        loss = model(torch.randn(3, 4, generator=gen)).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_the_full_state_moves_into_a_model_sharded_anew(world_of_one: None) -> None:
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    sharded = ShardedModel(FSDPConfig(build=lambda: _net(7)), net, opt)
    model = sharded.shard("cpu", 1)
    _train(model, opt, 3)
    sharded.gather()
    full = sharded.state_dict()
    assert set(full["optimizer"]["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    before = {k: v.clone() for k, v in full["model"].items()}
    sharded.release()  # the group goes; the full state stays
    assert opt.param_groups[0]["params"] == [] and not opt.state
    again = sharded.shard("cpu", 1)  # build() gives seed 7: everything comes from the state
    assert again is not model
    sharded.gather()
    for key, value in sharded.state_dict()["model"].items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    exp_avg = sharded.state_dict()["optimizer"]["state"]["2.weight"]["exp_avg"]
    torch.testing.assert_close(exp_avg, full["optimizer"]["state"]["2.weight"]["exp_avg"])
    assert int(sharded.state_dict()["optimizer"]["state"]["2.weight"]["step"]) == 3
    _train(again, opt, 1)  # the same optimizer object steps the new parameters


class _Rooted(nn.Module):
    """A root with parameters of its own (an embedding, as a transformer's) and one unit."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(8, 4)
        self.unit = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.unit(self.embed(x))


@pytest.mark.parametrize("reshard", [None, True])
def test_the_root_keeps_its_parameters_for_backward_by_default(
    world_of_one: None, reshard: bool | None
) -> None:
    # torch's default (None): the root does not reshard after forward, so its parameters
    # need no second all-gather in backward. The session used to pass True to the root
    # too: ~2 % of a step of the example's transformer (bench/overhead.py --arch).
    from torch.distributed.tensor import DTensor

    net = _Rooted()
    config = FSDPConfig(build=_Rooted, shard_modules=lambda m: [m.unit])
    if reshard is not None:
        config = FSDPConfig(
            build=_Rooted, shard_modules=lambda m: [m.unit], reshard_after_forward=reshard
        )
    model = ShardedModel(config, net, None).shard("cpu", 1)
    loss = model(torch.tensor([1, 2, 3])).sum()
    assert isinstance(model.unit.weight, DTensor)  # a unit reshards after forward
    assert isinstance(model.embed.weight, DTensor) is bool(reshard)
    loss.backward()
    assert isinstance(model.embed.weight, DTensor)  # resharded after backward either way


def test_a_stale_full_state_is_never_handed_out(world_of_one: None) -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sharded = ShardedModel(FSDPConfig(build=_net), net, opt)
    model = sharded.shard("cpu", 1)
    sharded.gather()
    sharded.state_dict()  # fresh: no step since the gather
    _train(model, opt, 1)
    sharded.release()  # as after a lost peer: the group is gone
    with pytest.raises(ShardsLostError, match=r"older than the last optimizer step"):
        sharded.state_dict()


def test_a_full_state_made_history_by_a_step_is_freed(world_of_one: None) -> None:
    """The gathered full state is a copy of the whole model and optimizer state on every
    rank: once a step makes it history (never handed out again) its memory goes."""
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    sharded = ShardedModel(FSDPConfig(build=_net), net, opt)
    model = sharded.shard("cpu", 1)
    _train(model, opt, 1)
    sharded.gather()
    kept = weakref.ref(sharded.state_dict()["optimizer"]["state"]["0.weight"]["exp_avg"])
    gc.collect()
    assert kept() is not None  # fresh: the session may still hand it out
    _train(model, opt, 1)
    gc.collect()
    assert kept() is None


def test_a_peer_state_of_another_model_is_refused_before_any_byte() -> None:
    net = _net()
    opt = torch.optim.Adam(net.parameters())
    _train(net, opt, 1)
    sharded = ShardedModel(FSDPConfig(build=_net), net, opt)
    spec = _spec(sharded.state_dict())
    sharded.check_state(spec)  # its own structure: accepted
    bigger = nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 2))
    other = ShardedModel(FSDPConfig(build=_net), bigger, torch.optim.Adam(bigger.parameters()))
    with pytest.raises(StateExchangeError, match=r"model\['0.weight'\].*\(7, 4\)"):
        other.check_state(spec)
    foreign = _spec(sharded.state_dict())
    foreign["optimizer"]["state"]["9.weight"] = foreign["optimizer"]["state"].pop("0.weight")
    with pytest.raises(StateExchangeError, match=r"state\['9.weight'\]: not a parameter"):
        sharded.check_state(foreign)
    wrong = _spec(sharded.state_dict())
    wrong["optimizer"]["state"]["0.weight"]["exp_avg"] = exchange.TensorSpec(torch.float32, (5,))
    with pytest.raises(StateExchangeError, match=r"\['exp_avg'\]: torch.float32 \[5\]"):
        sharded.check_state(wrong)
    wide = _spec(sharded.state_dict())
    wide["optimizer"]["state"]["0.weight"]["exp_avg"] = exchange.TensorSpec(torch.float64, (6, 4))
    with pytest.raises(StateExchangeError, match=r"\['exp_avg'\]: torch.float64 \[6, 4\]"):
        sharded.check_state(wide)  # never cast silently into float32 state
