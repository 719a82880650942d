"""The node channel (``slurm_elastic.channel``): one directory, one variable, one clear().

Real files and the real writers of every message (the agent's notice and assignments,
the workers' progress and registrations); the worker side resolves the directory from
the environment the agent gives it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurm_elastic import channel, envvars, notice
from slurm_elastic.channel import NODE_DIR_ENV, NodeChannel
from slurm_elastic.live import roster

ASSIGNMENT = roster.Assignment(4, 1, 2, 0, 1, 2, "127.0.0.1", 29500)


def write_every_message(node: NodeChannel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each message written by its real writer; the worker side through the environment."""
    monkeypatch.setenv(NODE_DIR_ENV, str(node.directory))
    notice.reload_environment()
    try:
        notice.raise_notice(node, reason="stop")  # agent
        assert notice.report_progress(7, force=True)  # worker, path from the environment
        roster.register_worker(node, 0, os.getpid(), live=False)  # worker
        roster.write_assignment(node, ASSIGNMENT)  # agent
        roster.mark_restart_path(node, 0, os.getpid())  # warm worker
        roster.mark_closed(node, 0, os.getpid())  # worker
    finally:
        notice.reload_environment()


def test_every_message_lives_in_the_one_directory_and_is_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = NodeChannel(tmp_path / "node")
    write_every_message(node, monkeypatch)
    names = sorted(os.listdir(node.directory))
    assert names == ["assign.0", "closed.0", "notice", "progress", "restart.0", "worker.0"]
    assert notice.notice_raised(node)
    assert notice.last_progress(node.progress) is not None
    assert roster.registered_workers(node, live=False) == {0: os.getpid()}
    assert roster.read_assignment(node, 0) == ASSIGNMENT
    # the module's list of messages names every file kind
    listed = channel.__doc__ or ""
    for kind in (
        "``notice``",
        "``progress``",
        "``worker.<local_rank>``",
        "``assign.<local_rank>``",
        "``restart.<local_rank>``",
        "``closed.<local_rank>``",
    ):
        assert kind in listed, kind


def test_clear_removes_every_message_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = NodeChannel(tmp_path / "node")
    write_every_message(node, monkeypatch)
    (node.directory / ".assign.0.999.tmp").write_text("torn")  # a writer killed mid-write
    (node.directory / "keep").write_text("not a message")
    node.clear()
    assert sorted(os.listdir(node.directory)) == ["keep"]
    assert not notice.notice_raised(node)
    assert roster.registered_workers(node, live=False) == {}
    assert roster.restart_path_pid(node, 0) is None
    node.clear()  # idempotent
    NodeChannel(tmp_path / "absent").clear()  # no directory: nothing to do


def test_the_workers_get_one_variable_for_the_channel() -> None:
    node = NodeChannel(Path("/tmp/slurm-elastic-node-1.2-x"))
    env = node.environment()
    assert env == {NODE_DIR_ENV: "/tmp/slurm-elastic-node-1.2-x"}
    assert NodeChannel.from_environ(env) == node
    assert NodeChannel.from_environ({}) is None
    assert NodeChannel.from_environ({NODE_DIR_ENV: ""}) is None
    # the agent's list of what it hands its workers has the one variable, no file paths
    from slurm_elastic.agent import WORKER_ENV

    assert NODE_DIR_ENV in WORKER_ENV
    node_vars = [n for n in WORKER_ENV if "FILE" in n or "DIR" in n]
    assert node_vars == [envvars.CHECKPOINT_DIR_ENV, envvars.EVENTS_DIR_ENV, NODE_DIR_ENV]
