"""Typed events: one dataclass per kind, schema version, unknown kinds kept, safe files."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path

import pytest

from slurm_elastic import events
from slurm_elastic.events import (
    EVENT_TYPES,
    SCHEMA_VERSION,
    CheckpointSaved,
    UnknownEvent,
    WorkersStarted,
    emit,
    event_from_record,
    read_events,
)


@pytest.fixture
def sink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "events"
    monkeypatch.setenv(events.EVENTS_DIR_ENV, str(directory))
    monkeypatch.setenv("SLURM_ELASTIC_RUN_ID", "run7")
    monkeypatch.setenv("SLURMD_NODENAME", "node3")
    return directory


def test_every_kind_is_one_registered_dataclass_that_round_trips() -> None:
    assert len(EVENT_TYPES) >= 20
    for kind, cls in EVENT_TYPES.items():
        assert cls.kind == kind and dataclasses.is_dataclass(cls)
        event = cls(time=1.5, host="h", pid=3, run_id="r")  # every field has a default
        back = event_from_record(json.loads(json.dumps(event.to_record())))
        assert type(back) is cls and back == event, kind


def test_emit_writes_a_typed_versioned_record_0600_and_read_returns_the_type(sink: Path) -> None:
    emit(CheckpointSaved(step=100, path="/c/step_100", bytes=10, seconds=0.5))
    (path,) = sink.glob("*.jsonl")
    assert path.name == f"node3.{os.getpid()}.jsonl"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    record = json.loads(path.read_text())
    assert record["v"] == SCHEMA_VERSION and record["kind"] == "checkpoint.saved"
    assert (record["host"], record["run_id"], record["step"]) == ("node3", "run7", 100)
    (event,) = read_events(sink)
    assert isinstance(event, CheckpointSaved)
    assert (event.step, event.path, event.format, event.run_id) == (
        100,
        "/c/step_100",
        "replicated",
        "run7",
    )
    assert event["step"] == 100 and event.get("nope", 5) == 5  # the record view still works


def test_emit_by_kind_name_builds_the_typed_event_and_old_sharded_kind_field_is_format(
    sink: Path,
) -> None:
    emit("checkpoint.saved", step=4, path="p", kind="sharded", note="x")
    emit("train.start", step=0, world_size=4, rank=1, total_steps=50)
    saved, start = read_events(sink)
    assert isinstance(saved, CheckpointSaved) and saved.format == "sharded"
    assert saved.extra == {"note": "x"} and saved["kind"] == "checkpoint.saved"
    assert isinstance(start, events.TrainStart) and start.total_steps == 50


def test_emit_does_not_follow_a_symlink_planted_at_its_file(sink: Path, tmp_path: Path) -> None:
    sink.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (sink / f"node3.{os.getpid()}.jsonl").symlink_to(victim)
    emit(WorkersStarted(group_world_size=2))  # never raises
    assert victim.read_text() == "precious\n"


def test_unknown_kinds_and_fields_of_a_newer_version_are_kept_torn_lines_skipped(
    tmp_path: Path,
) -> None:
    (tmp_path / "a.1.jsonl").write_text(
        json.dumps(
            {
                "v": 9,
                "kind": "agent.teleported",
                "time": 2.0,
                "host": "a",
                "pid": 1,
                "run_id": "r",
                "to": "mars",
            }
        )
        + "\n"
        + json.dumps(
            {
                "v": 9,
                "kind": "checkpoint.saved",
                "time": 1.0,
                "host": "a",
                "pid": 1,
                "run_id": "r",
                "step": 3,
                "tier": "nvme",
            }
        )
        + "\n"
        + "[1, 2]\n"
        + '{"v": 1, "kind": "agent.exit", "ti'  # torn last line
    )
    (tmp_path / "b.2.jsonl").write_text('{"kind": "agent.start"}\n')  # no time: not an event
    saved, unknown = read_events(tmp_path)  # ordered by time
    assert isinstance(saved, CheckpointSaved) and saved.step == 3 and saved.v == 9
    assert saved.extra == {"tier": "nvme"}
    assert isinstance(unknown, UnknownEvent) and unknown.kind == "agent.teleported"
    assert unknown.extra == {"to": "mars"}
    assert unknown.to_record()["to"] == "mars" and unknown.to_record()["kind"] == "agent.teleported"


def test_read_events_skips_a_symlinked_event_file(tmp_path: Path) -> None:
    outside = tmp_path / "outside.jsonl"
    outside.write_text(json.dumps({"kind": "agent.exit", "time": 1.0, "code": "X"}) + "\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "x.1.jsonl").symlink_to(outside)
    assert list(read_events(run)) == []


def test_run_index_is_private_and_ignores_entries_it_cannot_trust(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    events.record_run("123", state_dir=tmp_path / "s", events_dir=tmp_path / "s" / "events" / "123")
    entry = events.find_run("123")
    assert entry is not None and entry.events_dir == str(tmp_path / "s" / "events" / "123")
    path = events.run_index_dir() / "123.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert events.find_run("999") is None
    (events.run_index_dir() / "456.json").symlink_to(path)
    assert events.find_run("456") is None
    if os.getuid() == 0:
        os.chown(path, 65534, 65534)
        assert events.find_run("123") is None


SHARDED = """
import sys, torch, torch.distributed as dist
from slurm_elastic.checkpoint import CheckpointManager
from slurm_elastic.checkpoint.sharded import load_sharded, save_sharded
dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/pg", rank=0, world_size=1)
manager = CheckpointManager(sys.argv[1] + "/ckpt")
state = {"w": torch.ones(3)}
save_sharded(manager, state, 5)
load_sharded(manager, state)
dist.destroy_process_group()
"""


def test_sharded_checkpoint_events_keep_their_kind(tmp_path: Path) -> None:
    """The sharded save passed ``kind="sharded"``, which overwrote the record's kind: the
    events said ``"kind": "sharded"`` instead of ``checkpoint.saved``/``loaded``."""
    import subprocess
    import sys

    env = {**os.environ, events.EVENTS_DIR_ENV: str(tmp_path / "ev"), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", SHARDED, str(tmp_path)], env=env, check=True, timeout=120)
    got = [(e.kind, e.get("step"), e.get("format")) for e in read_events(tmp_path / "ev")]
    assert got == [("checkpoint.saved", 5, "sharded"), ("checkpoint.loaded", 5, "sharded")]


def test_status_says_why_a_node_was_evicted() -> None:
    """``rendezvous.evicted`` carries its cause: a killed agent (its link closed) or a
    silent one (no heartbeat for the window); the status shows which."""
    from slurm_elastic.cli.summary import summarize_run

    def node(pid: int, name: str, rank: int, t: float) -> list[events.Event]:
        base = {"host": "h", "pid": pid, "run_id": "r"}
        return [
            events.AgentStart(time=t, **base),
            events.RendezvousComplete(
                time=t + 1, round=0, rank=rank, world_size=3, node=name, **base
            ),
        ]

    evs = [*node(1, "h_1_0", 0, 0.0), *node(2, "h_2_0", 1, 0.0), *node(3, "h_3_0", 2, 0.0)]
    watcher = {"host": "h", "pid": 1, "run_id": "r"}
    evs += [
        events.RendezvousEvicted(time=5.0, nodes=["h_2_0"], cause="link", **watcher),
        events.RendezvousEvicted(time=9.0, nodes=["h_3_0"], **watcher),  # heartbeat
    ]
    summary = summarize_run("r", "/nowhere", evs, now=10.0)
    states = {n.rank: n.state for n in summary.nodes.values()}
    assert states[1] == "evicted (process gone)"
    assert states[2] == "evicted (no heartbeat)"
    assert summary.state == "RUNNING"  # node 1 runs; node 3 may only be silent
    # node 1 finishes: the run is over (node 2's killed agent never writes its exit; a
    # run that lost a node for good used to stay RUNNING forever; found using the
    # product by hand, 2026-12-04); node 3's silent agent may still be alive
    evs.append(events.AgentExit(time=12.0, code="FINISHED", **watcher))
    assert summarize_run("r", "/nowhere", evs, now=13.0).state == "RUNNING"
    evs.append(events.RendezvousEvicted(time=12.5, nodes=["h_3_0"], cause="link", **watcher))
    assert summarize_run("r", "/nowhere", evs, now=13.0).state == "COMPLETED"


def test_a_run_whose_tasks_were_all_stopped_is_cancelled_after_an_earlier_requeue() -> None:
    """Each task's *last* exit says how the run ended: a task preempted and requeued
    earlier (its first agent exited ``PREEMPTED_REQUEUED``) and then stopped with the
    others (``TERMINATED``) ended a cancelled run, not a failed one (seen using the
    product: every bench run that cancelled its job after a preemption read FAILED)."""
    from slurm_elastic.cli.summary import summarize_run

    def agent(pid: int, job: str, t: float, code: str) -> list[events.Event]:
        base = {"host": f"node{job[-1]}", "pid": pid, "run_id": "9"}
        return [
            events.AgentStart(time=t, job=job, **base),
            events.AgentExit(time=t + 10, code=code, **base),
        ]

    first = [*agent(1, "9_0", 0.0, "PREEMPTED_REQUEUED"), *agent(2, "9_1", 0.0, "TERMINATED")]
    first.insert(1, events.AgentRequeued(time=9.0, job="9_0", host="node0", pid=1, run_id="9"))
    evs = sorted([*first, *agent(3, "9_0", 12.0, "TERMINATED")], key=lambda e: e.time)
    summary = summarize_run("9", "/nowhere", evs, now=30.0)
    assert {n.key: n.state for n in summary.nodes.values()} == {
        "9_0": "terminated",
        "9_1": "terminated",
    }
    assert summary.state == "CANCELLED"
    # the requeued task not back yet: the run waits for it
    assert summarize_run("9", "/nowhere", evs[:-2], now=30.0).state == "PENDING"
    # a task whose last agent failed makes the run failed
    failed = [
        *evs[:-1],
        events.AgentExit(time=22.0, code="FAILED", host="node0", pid=3, run_id="9"),
    ]
    assert summarize_run("9", "/nowhere", failed, now=30.0).state == "FAILED"
