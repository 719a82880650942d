"""Robust to damage (#9.6), one run id used by two jobs (#9.4), no wall clock (#9.5)."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousParameters, RendezvousStateError

from slurm_elastic.rendezvous import create_handler
from slurm_elastic.rendezvous.backend import FileRendezvousBackend
from slurm_elastic.rendezvous.run_directory import Incarnation, RunDirectory, RunIdInUseError
from slurm_elastic.rendezvous.state import Node, State, decode_state, encode_state
from tests.helpers import wait_for


def _state(round_: int) -> bytes:
    return encode_state(State(round=round_))


def _round(blob: bytes) -> int:
    return decode_state(blob).round


def _written(tmp_path: Path, n: int) -> tuple[FileRendezvousBackend, Any]:
    tmp_path.mkdir(mode=0o700, exist_ok=True)
    b = FileRendezvousBackend(tmp_path)
    token = None
    for i in range(n):
        _, token, _ = b.set_state(_state(i + 1), token)
    return b, token


# -- a damaged or planted head ------------------------------------------------------------


def _plant_past(head: Path) -> None:
    head.unlink()
    head.write_text(str(10**9))


def _plant_symlink(head: Path) -> None:
    head.unlink()
    (head.parent / "elsewhere").write_text("3")
    os.symlink(head.parent / "elsewhere", head)


def _plant_directory(head: Path) -> None:
    head.unlink()
    head.mkdir()
    (head / "x").write_text("y")


def _plant_garbage(head: Path) -> None:
    head.write_bytes(b"\xff\xfe not a number")


@pytest.mark.parametrize(
    "plant", [_plant_past, _plant_symlink, _plant_directory, _plant_garbage],
    ids=["past-newest", "symlink", "directory", "garbage"],
)  # fmt: skip
def test_a_damaged_head_is_recovered_from(tmp_path: Path, plant: Any) -> None:
    _, token = _written(tmp_path, 70)  # across a segment boundary
    plant(tmp_path / "head")
    reader = FileRendezvousBackend(tmp_path)  # a node starting now
    blob, got = reader.get_state()
    assert got == token and _round(blob) == 70
    _, new, ok = reader.set_state(_state(71), got)  # writers go on ...
    assert ok and new == token + 1
    assert (tmp_path / "head").is_file() and not (tmp_path / "head").is_symlink()
    assert int((tmp_path / "head").read_text()) == new  # ... and repair the head
    assert FileRendezvousBackend(tmp_path).get_state()[1] == new


def test_a_deleted_run_directory_is_reported_and_the_cache_dropped(tmp_path: Path) -> None:
    run = RunDirectory(tmp_path / "rdzv", "r")
    era = run.select_era(Incarnation("g", "k"))
    b = era.backend()
    _, token, _ = b.set_state(_state(1), None)
    assert b.get_state()[1] == token
    shutil.rmtree(tmp_path / "rdzv" / "r")
    with pytest.raises(RendezvousStateError, match="was deleted while in use"):
        b.get_state()
    with pytest.raises(RendezvousStateError, match="was deleted while in use"):
        b.set_state(_state(2), token)
    with pytest.raises(RendezvousStateError, match="was deleted while in use"):
        era.read_store()


# -- one run id, two jobs -------------------------------------------------------------------

_FAST = {"heartbeat_interval": "0.2", "heartbeat_miss_limit": "3", "last_call_timeout": "0.2"}


def _params(root: Path, min_n: int = 1, max_n: int = 2, **conf: str) -> RendezvousParameters:
    return RendezvousParameters(
        "slurm", str(root), "shared-id", min_n, max_n, local_addr="127.0.0.1", **{**_FAST, **conf}
    )


def test_a_second_job_with_the_same_run_id_is_refused_and_the_first_untouched(
    tmp_path: Path,
) -> None:
    job_a = {"SLURM_JOB_ID": "41", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "0"}
    a = create_handler(_params(tmp_path), environ=job_a)
    try:
        info = a.next_rendezvous()
        assert info.world_size == 1
        eras_before = sorted(p.name for p in a.era.path.parent.iterdir())
        token_before = a.era.backend().get_state()[1]
        with pytest.raises(RunIdInUseError, match=r"in use by another live job \(Slurm job 40"):
            create_handler(_params(tmp_path), environ={"SLURM_JOB_ID": "50"})
        with pytest.raises(RunIdInUseError, match="rdzv-id"):  # another array, too
            create_handler(
                _params(tmp_path),
                environ={"SLURM_JOB_ID": "61", "SLURM_ARRAY_JOB_ID": "60",
                         "SLURM_ARRAY_TASK_ID": "1"},
            )  # fmt: skip
        # Nothing of job A's was joined, replaced or deleted.
        assert sorted(p.name for p in a.era.path.parent.iterdir()) == eras_before
        assert a.era.backend().get_state()[1] == token_before
        assert a.num_nodes_waiting() == 0
        # A task of job A's own array still joins it.
        b = create_handler(
            _params(tmp_path),
            environ={"SLURM_JOB_ID": "42", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "1"},
        )
        assert b.era.number == a.era.number
    finally:
        a.leave()
    # Once job A is gone (no heartbeat moves), the run id is free again.
    c = create_handler(_params(tmp_path), environ={"SLURM_JOB_ID": "50"})
    assert c.era.number == a.era.number + 1


def test_a_requeued_plain_job_takes_over_its_own_earlier_era(tmp_path: Path) -> None:
    first = create_handler(_params(tmp_path), environ={"SLURM_JOB_ID": "7"})
    first.next_rendezvous()  # and it keeps beating: still "live" by its heartbeats
    try:
        again = create_handler(
            _params(tmp_path), environ={"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}
        )
        assert again.era.number == first.era.number + 1
    finally:
        first.leave()


# -- the last call is timed on the reader's monotonic clock ----------------------------------


def test_a_last_call_written_by_a_node_with_a_fast_clock_does_not_stall_the_others(
    tmp_path: Path,
) -> None:
    """A node whose clock is an hour ahead reaches min_nodes (so it writes the last-call
    deadline) and then stops: the other node completes after *its own* last call."""
    h = create_handler(
        _params(tmp_path, 2, 3, heartbeat_miss_limit="200", last_call_timeout="0.5",
                join_timeout="60"),
        environ={},
    )  # fmt: skip
    result: dict[str, Any] = {}

    def join() -> None:
        try:
            result["info"] = h.next_rendezvous()
        except BaseException as exc:  # reported below
            result["error"] = exc

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    backend = h.era.backend()

    def joined() -> Any:
        cur = backend.get_state()
        return cur if cur and decode_state(cur[0]).participants else None

    blob, token = wait_for(joined, 30, "the node to join")
    state = decode_state(blob)
    skewed = Node("zz-skewed-node", 4242, 0)  # sorts after 127.0.0.1: rank 1
    state.participants.add(skewed)
    state.calls += 1
    state.last_call = state.calls  # an id, no time: no clock of another node to trust
    _, _, ok = backend.set_state(encode_state(state), token)
    assert ok
    thread.join(45)  # join_timeout is 60 s: the old behaviour waits an hour and fails
    try:
        assert "error" not in result, result.get("error")
        assert not thread.is_alive(), "the round did not complete: it waits for the wall clock"
        assert result["info"].world_size == 2 and result["info"].rank == 0
    finally:
        h.shutdown()
