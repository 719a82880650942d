"""Telling a script without ``ElasticSession`` from one still starting (the restart-path
mark of the node channel: ``roster.watch_for_restart_path``).

Real files in a real channel directory and the real watch thread; the process group is a
callable seam here (a flag the test sets, standing in for
``torch.distributed.is_initialized``): the agent tests run the real one
(``tests/agent/test_agent_local.py``, a plain ``init_process_group`` script).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from slurm_elastic.channel import NodeChannel
from slurm_elastic.live import roster
from tests.helpers import wait_for


def channel_in(tmp_path: Path) -> NodeChannel:
    node = NodeChannel(tmp_path / "node")
    node.directory.mkdir(mode=0o700)
    return node


def test_a_group_made_without_a_registration_is_marked(tmp_path: Path) -> None:
    node = channel_in(tmp_path)
    group = threading.Event()
    thread = roster.watch_for_restart_path(node, 1, os.getpid(), group.is_set, poll_s=0.01)
    assert roster.restart_path_pid(node, 1) is None
    group.set()  # the script's init_process_group
    thread.join(10)
    assert not thread.is_alive()
    assert roster.restart_path_pid(node, 1) == os.getpid()
    assert roster.restart_path_pid(node, 0) is None  # the mark names its local rank


@pytest.mark.parametrize("live", [False, True])
@pytest.mark.parametrize("group_first", [False, True], ids=["then-the-group", "group-seen-first"])
def test_a_worker_registered_with_a_group_is_not_marked(
    tmp_path: Path, live: bool, group_first: bool
) -> None:
    # ElasticSession in place registers (as starting, later live) before it makes its
    # group: whenever the watch looks, a group comes with this pid's registration.
    node = channel_in(tmp_path)
    group = threading.Event()
    roster.register_worker(node, 0, os.getpid(), live=live)
    if group_first:
        group.set()
    thread = roster.watch_for_restart_path(node, 0, os.getpid(), group.is_set, poll_s=0.01)
    thread.join(10)
    assert not thread.is_alive()
    group.set()
    assert roster.restart_path_pid(node, 0) is None
    assert not node.restart_path(0).exists()


def test_another_process_registration_does_not_count(tmp_path: Path) -> None:
    # A stale registration (a previous worker's pid) is not this worker's.
    node = channel_in(tmp_path)
    roster.register_worker(node, 0, os.getpid() + 1, live=False)
    group = threading.Event()
    thread = roster.watch_for_restart_path(node, 0, os.getpid(), group.is_set, poll_s=0.01)
    group.set()
    thread.join(10)
    assert roster.restart_path_pid(node, 0) == os.getpid()


def test_the_watch_ends_when_the_channel_goes(tmp_path: Path) -> None:
    node = channel_in(tmp_path)
    thread = roster.watch_for_restart_path(node, 0, os.getpid(), lambda: False, poll_s=0.01)
    shutil.rmtree(node.directory)
    wait_for(lambda: not thread.is_alive(), 10, "the watch to end")


def test_the_mark_is_cleared_with_the_other_messages(tmp_path: Path) -> None:
    node = channel_in(tmp_path)
    roster.mark_restart_path(node, 0, os.getpid())
    assert roster.restart_path_pid(node, 0) == os.getpid()
    node.clear()
    assert roster.restart_path_pid(node, 0) is None


def agent_defers(node: NodeChannel, pid: int, started_ago_s: float) -> tuple[bool, bool]:
    """The agent's own decision (``SlurmElasticAgent._defer_for_starting_workers``) on a
    stand-in holding only what it reads; returns (defers, remembers the script's kind)."""
    from slurm_elastic.agent.elastic_agent import SlurmElasticAgent

    stand_in = SimpleNamespace(
        _channel=node,
        _own_group_script=False,
        _workers_started_at=time.monotonic() - started_ago_s,
        _leave_timeout_s=60.0,
        _deferring=False,
    )
    stand_in._script_makes_its_own_group = lambda wg: SlurmElasticAgent._script_makes_its_own_group(
        stand_in,  # type: ignore[arg-type]
        wg,
    )
    group = SimpleNamespace(
        workers=[SimpleNamespace(local_rank=0, id=pid)],
        spec=SimpleNamespace(rdzv_handler=object()),
    )
    defers = SlurmElasticAgent._defer_for_starting_workers(stand_in, group)  # type: ignore[arg-type]
    return defers, stand_in._own_group_script


@pytest.mark.parametrize("started_ago_s", [1.0, 1000.0], ids=["in-the-window", "past-it"])
def test_the_agent_learns_the_mark_of_a_current_worker_in_or_past_the_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started_ago_s: float
) -> None:
    # Past the window the agent restarts anyway, but it must still learn the script's kind
    # there: the restart clears the marks and its cold workers write none.
    monkeypatch.delenv(roster.IN_PLACE_ENV, raising=False)
    node = channel_in(tmp_path)
    roster.mark_restart_path(node, 0, 4242)
    assert agent_defers(node, 4242, started_ago_s) == (False, True)


def test_the_agent_ignores_the_mark_of_a_previous_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(roster.IN_PLACE_ENV, raising=False)
    node = channel_in(tmp_path)
    roster.mark_restart_path(node, 0, 4241)  # not the current worker's pid
    assert agent_defers(node, 4242, 1000.0) == (False, False)
