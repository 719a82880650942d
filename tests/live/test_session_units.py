"""``ElasticSession`` and the registered state in one process (world 1, real gloo group).

The multi-node behaviour (join, leave, hard loss in place) is in ``test_own_loop.py``;
here: registration errors, the commit/rollback of every registered object, the peer
check of registered objects, and the loader-facing ``batches()`` against the steps.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from slurm_elastic.checkpoint import exchange
from slurm_elastic.errors import StateExchangeError
from slurm_elastic.live import ElasticSession, ElasticState


def _parts() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    body = torch.optim.SGD(net[0].parameters(), lr=0.1, momentum=0.9)
    head = torch.optim.Adam(net[2].parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    return net, body, head, scaler


def _train(net: nn.Module, body: torch.optim.Optimizer, head: torch.optim.Optimizer,
           scaler: Any) -> None:  # fmt: skip
    loss = net(torch.randn(5, 4)).pow(2).sum()
    scaler.scale(loss).backward()
    scaler.step(body)
    scaler.step(head)
    scaler.update()


def _spec(tree: Any) -> Any:
    """What a receiver checks: the announced tree with a TensorSpec per tensor."""
    if isinstance(tree, torch.Tensor):
        return exchange.TensorSpec(tree.dtype, tuple(tree.shape))
    if isinstance(tree, dict):
        return {k: _spec(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_spec(v) for v in tree]
    return tree


def test_a_stateful_object_needs_state_dict_and_load_state_dict() -> None:
    net, body, _, _ = _parts()
    with pytest.raises(TypeError, match=r"stateful\['lr'\] is a float: it needs state_dict"):
        ElasticState(net, body, stateful={"lr": 0.1})


def test_restore_rolls_back_every_registered_object() -> None:
    net, body, head, scaler = _parts()
    state = ElasticState(net, body, stateful={"head": head, "scaler": scaler}, step=0)
    _train(net, body, head, scaler)
    state.commit()
    saved = (
        {k: v.clone() for k, v in net.state_dict().items()},
        head.state_dict()["state"][0]["exp_avg"].clone(),
        scaler.get_scale(),
    )
    for _ in range(3):
        _train(net, body, head, scaler)
    assert scaler.get_scale() != saved[2]
    state.restore()
    for k, v in net.state_dict().items():
        torch.testing.assert_close(v, saved[0][k])
    torch.testing.assert_close(head.state_dict()["state"][0]["exp_avg"], saved[1])
    assert scaler.get_scale() == saved[2]


def test_a_peer_state_with_a_different_registered_object_is_refused() -> None:
    net, body, head, scaler = _parts()
    state = ElasticState(net, body, stateful={"head": head, "ema": nn.Linear(3, 1)}, step=0)
    _train(net, body, head, scaler)
    state.commit()
    spec = _spec({"state": state.snapshot(), "id": [0, 1]})
    state.check_received(spec)  # its own shape: accepted
    other = ElasticState(net, body, stateful={"head": head, "ema": nn.Linear(3, 2)}, step=0)
    with pytest.raises(StateExchangeError, match=r"stateful\['ema'\]\['weight'\].*\[1, 3\]"):
        other.check_received(spec)
    missing = ElasticState(net, body, stateful={"head": head}, step=0)
    with pytest.raises(StateExchangeError, match=r"stateful: keys \[.ema., .head.\]"):
        missing.check_received(spec)


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
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_batches_are_the_steps_indices_and_an_epoch_end_interrupts(world_of_one: None) -> None:
    net, body, head, scaler = _parts()
    session = ElasticSession(
        net, body, stateful={"head": head, "scaler": scaler},
        dataset_size=10, global_batch_size=4, seed=3,
    )  # fmt: skip
    seen: list[list[int]] = []
    epochs = 0
    while not session.finished(steps=5):
        for indices in session.batches():
            with session.step() as step:
                assert step.indices == indices and step.world_size == 1
                seen.append(indices)
                _train(net, body, head, scaler)
            if session.interrupted or session.reached(steps=5):
                break
        epochs += 1
    assert session.finish() == "done" and session.step_count == 5
    # 10 samples in batches of 4: 4 + 4 + 2 per epoch; every sample once per epoch
    assert [len(i) for i in seen] == [4, 4, 2, 4, 4]
    assert sorted(i for batch in seen[:3] for i in batch) == list(range(10))
    assert epochs == 2 and session.epoch == 1 and session.sample_offset == 8
    session.close()
