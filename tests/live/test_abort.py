"""The stall guard (``slurm_elastic.live.abort``): when it shuts a blocked group's
connections down, and that it touches nothing else. Real sockets and channel files; the
guard's clock is injected (its thread is parked with a long poll interval, and
``check()`` is called directly)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slurm_elastic.channel import NodeChannel
from slurm_elastic.live import ElasticLoop, roster
from slurm_elastic.live.abort import StallGuard, connected_sockets, shut_down_sockets


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def connection() -> Iterator[tuple[socket.socket, socket.socket, frozenset[int]]]:
    """A connected TCP pair; the inodes that appeared on this side while connecting."""
    listener = socket.create_server(("127.0.0.1", 0))
    before = connected_sockets()
    client = socket.create_connection(listener.getsockname())
    mine = connected_sockets() - before
    server, _ = listener.accept()
    server.settimeout(5)
    yield client, server, mine
    for s in (client, server, listener):
        s.close()


def assignment(
    round_: int, *, after_loss: bool, loss_round: int | None = None
) -> roster.Assignment:
    """As the agent writes it: a round formed after a loss is its own ``loss_round``."""
    if loss_round is None:
        loss_round = round_ if after_loss else -1
    return roster.Assignment(
        round_, 0, 2, 0, 0, 1, "127.0.0.1", 1234, after_loss=after_loss, loss_round=loss_round
    )


def test_shutting_down_the_group_sockets_ends_the_peers_read(connection) -> None:
    client, server, mine = connection
    assert len(mine) == 1
    assert shut_down_sockets(mine) == 1
    assert server.recv(1) == b""  # end of stream, as after a peer's death
    with pytest.raises(OSError):
        client.send(b"x")


def test_sockets_outside_the_set_and_listeners_are_left_alone(connection) -> None:
    client, _server, _ = connection
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        everything_but_client = connected_sockets() - {_inode(client)}
        shut_down_sockets(everything_but_client)  # server side and a listener included
        client.sendall(b"ok")  # the client's own socket still works
        listener.settimeout(0.01)
        with pytest.raises(TimeoutError):
            listener.accept()  # still listening (no error)
    finally:
        listener.close()


def _inode(sock: socket.socket) -> int:
    return int(os.readlink(f"/proc/self/fd/{sock.fileno()}")[8:-1])


def test_guard_aborts_only_a_stall_after_a_lost_member(tmp_path: Path, connection) -> None:
    _client, server, mine = connection
    clock = Clock()
    guard = StallGuard(
        NodeChannel(tmp_path), 0, min_stall_s=1.0, stall_factor=3.0, poll_s=3600, clock=clock
    )
    try:
        guard.arm(5, mine)
        for _ in range(3):  # steps of 0.5 s: threshold max(1, 3 x 0.5) = 1.5 s
            clock.now += 0.5
            guard.beat()
        assert guard.threshold_s() == pytest.approx(1.5)
        clock.now += 10.0
        assert not guard.check()  # stalled, but no newer round
        roster.write_assignment(NodeChannel(tmp_path), assignment(6, after_loss=False))
        assert not guard.check()  # a newer round for a newcomer only: a long step, no loss
        guard.arm(6, mine)
        for _ in range(3):
            clock.now += 0.5
            guard.beat()
        clock.now += 1.4
        roster.write_assignment(NodeChannel(tmp_path), assignment(7, after_loss=True))
        assert not guard.check()  # a member was lost but this worker still steps
        # a newcomer's round overwrites round 7's assignment; the agent carries the loss
        roster.write_assignment(NodeChannel(tmp_path), assignment(8, after_loss=False))
        clock.now += 0.2
        assert not guard.check()  # (an assignment that did not carry it: no loss seen)
        roster.write_assignment(
            NodeChannel(tmp_path), assignment(8, after_loss=False, loss_round=7)
        )
        assert guard.check()  # stalled 1.6 s > 1.5 s, a loss since round 6: abort
        assert server.recv(1) == b""
        assert not guard.check() and guard.aborts == 1  # once per group
    finally:
        guard.close()


def test_a_disarmed_guard_touches_nothing(tmp_path: Path, connection) -> None:
    client, server, mine = connection
    clock = Clock()
    guard = StallGuard(NodeChannel(tmp_path), 0, poll_s=3600, clock=clock)
    try:
        guard.arm(1, mine)
        guard.disarm()  # the group is being torn down
        roster.write_assignment(NodeChannel(tmp_path), assignment(2, after_loss=True))
        clock.now += 60
        assert not guard.check()
        client.sendall(b"ok")
        assert server.recv(2) == b"ok"
    finally:
        guard.close()


def test_after_loss_is_optional_and_must_be_a_bool() -> None:
    data = assignment(3, after_loss=True).as_dict()
    assert roster.Assignment.from_dict(data).after_loss is True
    del data["after_loss"]
    assert roster.Assignment.from_dict(data).after_loss is False  # older agents
    with pytest.raises(ValueError, match="after_loss='yes' is not true or false"):
        roster.Assignment.from_dict({**data, "after_loss": "yes"})


def test_loss_round_is_optional_and_not_after_the_round() -> None:
    data = assignment(5, after_loss=False, loss_round=3).as_dict()
    assert roster.Assignment.from_dict(data).loss_round == 3
    del data["loss_round"]
    assert roster.Assignment.from_dict(data).loss_round == -1  # older agents: none
    with pytest.raises(ValueError, match="loss_round=6 is after round=5"):
        roster.Assignment.from_dict({**data, "loss_round": 6})
    with pytest.raises(ValueError, match="loss_round=True is not an integer"):
        roster.Assignment.from_dict({**data, "loss_round": True})


def test_the_guard_sleeps_until_a_step_is_overdue(tmp_path: Path, connection) -> None:
    """While steps come, the thread wakes about once a second, not every ``poll_s``
    (each wake takes the GIL from the training loop): it reads nothing before a step is
    overdue, and once it is, it looks every ``poll_s``."""
    _client, _server, mine = connection
    clock = Clock()
    guard = StallGuard(NodeChannel(tmp_path), 0, min_stall_s=1.0, poll_s=0.05, clock=clock)
    try:
        assert guard.next_look_s() == 1.0  # disarmed: nothing to watch
        guard.arm(5, mine)
        for _ in range(3):  # steps of 0.2 s: threshold max(1, 3 x 0.2) = 1 s
            clock.now += 0.2
            guard.beat()
        assert guard.next_look_s() == pytest.approx(1.0)  # the next step is due in 1 s
        clock.now += 0.7
        assert guard.next_look_s() == pytest.approx(0.3)
        clock.now += 0.3
        assert guard.next_look_s() == 0.05  # overdue: every poll_s
        for _ in range(4):  # steps of 2 s: threshold 6 s, but sleeps are capped at 1 s
            clock.now += 2.0
            guard.beat()
        assert guard.next_look_s() == 1.0
    finally:
        guard.close()


def test_bad_stall_bounds_get_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"min_stall_s=0: must be > 0"):
        StallGuard(NodeChannel(tmp_path), 0, min_stall_s=0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"stall_abort_s=-1.0 must be > 0 seconds, or None"):
        ElasticLoop(model, opt, dataset_size=8, global_batch_size=4, stall_abort_s=-1.0)


def test_a_collective_that_outlives_its_abort_ends_the_worker(tmp_path: Path, connection) -> None:
    """gloo may leave a send waiting after its connections closed, whether the abort found
    nothing left to shut down (a node thawed after its eviction) or shut connections down
    (a ring all-reduce's ``waitSend``, seen in the Slurm e2e case): ``stuck_s`` after an
    abort, with the main thread still in its step, the worker exits for its agent to
    restart it. Leaving the step in time (the collective raised: ``disarm``/``arm``; or a
    step boundary: ``beat``) keeps it alive."""
    _client, _server, mine = connection
    clock = Clock()
    exits: list[int] = []
    guard = StallGuard(NodeChannel(tmp_path), 0, poll_s=3600, stuck_s=10.0, clock=clock,
                       exit=exits.append)  # fmt: skip
    try:
        cases = ((1, frozenset(), "disarm"), (3, frozenset(), "arm"), (5, frozenset(), "beat"),
                 (7, mine, None), (9, frozenset(), None))  # fmt: skip
        for round_, sockets, leave in cases:
            exits.clear()
            guard.arm(round_, sockets)
            roster.write_assignment(NodeChannel(tmp_path), assignment(round_ + 1, after_loss=True))
            clock.now += 5.0
            assert guard.check()  # aborted
            clock.now += 9.0
            assert not guard.check() and not exits  # within stuck_s: the loop may still act
            if leave == "disarm":
                guard.disarm()  # the collective raised; the group is torn down
            elif leave == "arm":
                guard.arm(round_ + 1, frozenset())
            elif leave == "beat":
                guard.beat()  # the step ended after all
            clock.now += 2.0
            assert not guard.check()
            assert exits == ([] if leave else [1]), round_  # still in it 11 s on: exits
            clock.now += 50.0
            assert not guard.check() and exits == ([] if leave else [1]), round_  # once
    finally:
        guard.close()
