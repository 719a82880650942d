"""A worker skips a round whose store is gone once a newer round is assigned.

Seen in the storm of ``bench/goodput.py`` (docs/live.md): a node thawed after a freeze
finds the rounds it missed gone. torch retries a refused store connect until its timeout
(after a back-off, once more), so each stale round cost the worker ~27 s while the survivors waited
for it in the newest round's formation. Now the connect is tried in short slices and a
newer assignment ends it (``RoundSupersededError``, a peer failure: the loop goes on to
the next round). Real parts: a real ``TCPStore`` for the newer round, a port with nothing
behind it for the stale one, the real channel files and ``LiveWorld``.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from slurm_elastic.channel import NODE_DIR_ENV, NodeChannel
from slurm_elastic.errors import RoundSupersededError
from slurm_elastic.live import ElasticState, auth, roster
from slurm_elastic.live.world import LiveWorld, is_peer_failure
from slurm_elastic.privatefs import ensure_private_dir
from tests.store_host import store_host


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _world(directory: Path, monkeypatch: pytest.MonkeyPatch) -> LiveWorld:
    monkeypatch.setenv(NODE_DIR_ENV, str(directory))
    monkeypatch.setenv(roster.ROUND_ENV, "3")
    live = LiveWorld(
        ElasticState(torch.nn.Linear(1, 1)),
        backend="gloo",
        ddp_kwargs={},
        timeout=timedelta(seconds=60),
        reform_timeout_s=30,
        in_place=True,
        stall_abort_s=None,
    )
    live._watch = roster.AssignmentWatch(NodeChannel(directory), 0, 3)
    return live


def _assignment(round_: int, port: int) -> roster.Assignment:
    return roster.Assignment(round_, 0, 1, 0, 0, 1, "127.0.0.1", port)


def _call_until_given_up(
    call: Callable[[], object], newer: roster.Assignment, directory: Path
) -> tuple[BaseException | None, float]:
    """Write ``newer`` 1 s from now and run ``call`` on a thread (the code before the
    fixes never returned): what it raised (``None``: it returned) and after how long.

    Raises:
        AssertionError: still waiting after 30 s.
    """
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the test's thread
            outcome.append(exc)
        else:
            outcome.append(None)

    writer = threading.Timer(1.0, roster.write_assignment, (NodeChannel(directory), newer))
    started = time.monotonic()
    writer.start()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    took = time.monotonic() - started
    writer.cancel()
    assert not thread.is_alive(), f"still waiting on the frozen host after {took:.1f} s"
    return outcome[0], took


def test_a_stale_round_whose_store_is_gone_is_skipped_for_the_newer_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "node"
    directory.mkdir(mode=0o700)
    live = _world(directory, monkeypatch)
    stale = _assignment(4, _free_port())  # its store is gone: nothing listens there
    roster.write_assignment(NodeChannel(directory), stale)
    assert live._watch is not None and live._watch.poll(force=True) == stale
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True)
    newer = _assignment(5, master.port)
    writer = threading.Timer(0.5, roster.write_assignment, (NodeChannel(directory), newer))
    started = time.monotonic()
    writer.start()
    try:
        with pytest.raises(RoundSupersededError, match="round 5 is assigned") as caught:
            live._connect(stale)
        took = time.monotonic() - started
        # before: torch's 10-s connect timeout, its back-off and a second try (27 s here)
        assert took < 8.0, f"{took:.1f} s to give up on the stale round"
        assert is_peer_failure(caught.value)  # the loop waits for the next round
        # the readiness poll now holds the newer round, all of its ranks ready
        assert live.ready_round() == newer.round + 1
        assert live.pending_round() == newer.round
    finally:
        writer.cancel()


def test_a_group_forming_for_a_round_whose_peers_went_on_gives_up_for_the_newer_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The storm's stall (docs/live.md): a survivor switched to round 12 after its peers
    # announced themselves ready there; one of them was then restarted by its agent and
    # the other skipped to round 13. The survivor waited in round 12's group formation
    # for them until the collective timeout while round 13 waited for it. Here rank 1 of
    # round 5 never comes, and round 6 is assigned one second into the formation.
    keys = ensure_private_dir(tmp_path / "rdzv" / ".keys", root=tmp_path / "rdzv")
    key_file = auth.load_or_create_key(keys, "run.key")
    monkeypatch.setenv(auth.KEY_FILE_ENV, str(key_file))
    directory = tmp_path / "node"
    directory.mkdir(mode=0o700)
    live = _world(directory, monkeypatch)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True)
    forming = roster.Assignment(5, 0, 2, 0, 0, 2, "127.0.0.1", master.port)
    roster.write_assignment(NodeChannel(directory), forming)
    newer = roster.Assignment(6, 0, 1, 0, 0, 1, "127.0.0.1", master.port)
    writer = threading.Timer(1.0, roster.write_assignment, (NodeChannel(directory), newer))
    started = time.monotonic()
    writer.start()
    try:
        with pytest.raises(Exception) as caught:
            live._join(forming, live._connect(forming))
        took = time.monotonic() - started
        assert is_peer_failure(caught.value), repr(caught.value)  # the loop recovers
        assert "round 6 is assigned" in str(caught.value)
        # before: the whole collective timeout (60 s here; 75-120 s in the storm)
        assert took < 15.0, f"{took:.1f} s in a formation whose peers went on"
    finally:
        writer.cancel()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_starting_worker_whose_first_round_is_superseded_waits_for_its_agents_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A starting worker's agent restarts it for the newer round (it trained nothing);
    # failing at once would be charged to max_restarts as a worker failure. So open()
    # waits (reform_timeout_s here: 2 s) for that restart before it gives up.
    keys = ensure_private_dir(tmp_path / "rdzv" / ".keys", root=tmp_path / "rdzv")
    monkeypatch.setenv(auth.KEY_FILE_ENV, str(auth.load_or_create_key(keys, "run.key")))
    directory = tmp_path / "node"
    directory.mkdir(mode=0o700)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True)
    first = roster.Assignment(3, 0, 2, 0, 0, 2, "127.0.0.1", master.port)
    live = _world(directory, monkeypatch)  # sets the round: 3
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master.port),
    }.items():
        monkeypatch.setenv(name, value)
    assert roster.Assignment.from_environ() == first
    live.reform_timeout_s = 2.0
    newer = roster.Assignment(4, 0, 1, 0, 0, 1, "127.0.0.1", master.port)
    writer = threading.Timer(1.0, roster.write_assignment, (NodeChannel(directory), newer))
    started = time.monotonic()
    writer.start()
    try:
        with pytest.raises(RoundSupersededError, match="round 4 is assigned"):
            live.open()
        took = time.monotonic() - started
        # registered as starting (the agent restarts it at once), and it did wait
        assert roster.registered_workers(NodeChannel(directory), live=False)
        assert took >= 1.0 + live.reform_timeout_s, f"gave up after {took:.1f} s"
        assert took < 20.0, f"{took:.1f} s"
    finally:
        writer.cancel()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_round_whose_store_host_is_frozen_is_skipped_for_the_newer_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A frozen host (SIGSTOP) still accepts the connection; torch's connect then waits
    # for the answer to its ping with no timeout (docs/reliability.md). Before, a worker
    # connecting to such a round waited until the host died or thawed; now a newer
    # assignment ends the wait. Real parts: a TCPStore served by a stopped process.
    directory = tmp_path / "node"
    directory.mkdir(mode=0o700)
    live = _world(directory, monkeypatch)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True)
    newer = _assignment(5, master.port)
    with store_host() as (host, port):  # the host is killed on the way out
        os.kill(host.pid, signal.SIGSTOP)
        stale = _assignment(4, port)
        roster.write_assignment(NodeChannel(directory), stale)
        assert live._watch is not None and live._watch.poll(force=True) == stale
        raised, took = _call_until_given_up(lambda: live._connect(stale), newer, directory)
    assert isinstance(raised, RoundSupersededError), repr(raised)
    assert "round 5 is assigned" in str(raised)
    assert is_peer_failure(raised)  # the loop waits for the next round
    assert 1.0 <= took < 10.0, f"{took:.1f} s to give up on the frozen round"


def test_a_group_forming_on_a_store_whose_host_froze_gives_up_for_the_newer_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The store host freezes after the worker connected, while its group forms: torch's
    # calls inside init_process_group (a timed-out wait cancels and waits for the answer)
    # then wait with no timeout. Before, the worker waited there until the host died or
    # thawed; now the sealed store's calls give up once a newer round is assigned.
    keys = ensure_private_dir(tmp_path / "rdzv" / ".keys", root=tmp_path / "rdzv")
    monkeypatch.setenv(auth.KEY_FILE_ENV, str(auth.load_or_create_key(keys, "run.key")))
    directory = tmp_path / "node"
    directory.mkdir(mode=0o700)
    live = _world(directory, monkeypatch)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True)
    try:
        with store_host() as (host, port):  # the host is killed on the way out
            forming = roster.Assignment(5, 0, 2, 0, 0, 2, "127.0.0.1", port)
            roster.write_assignment(NodeChannel(directory), forming)
            store = live._connect(forming)  # the host still answers
            os.kill(host.pid, signal.SIGSTOP)
            newer = roster.Assignment(6, 0, 1, 0, 0, 1, "127.0.0.1", master.port)
            raised, took = _call_until_given_up(
                lambda: live._join(forming, store), newer, directory
            )
        assert raised is not None and is_peer_failure(raised), repr(raised)
        assert "round 6 is assigned" in str(raised)
        assert 1.0 <= took < 10.0, f"{took:.1f} s to give up on the frozen round"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
