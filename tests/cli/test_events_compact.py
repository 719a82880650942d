"""Bounded event directories (slurm_elastic.events.compact): the files of a node's gone
processes merged into its archive, crash-safe, nothing lost or read twice.

Real processes write the files (the writer's own path: ``emit`` in a child process) and
real processes are gone or alive (``/proc``); the "crash" cases leave on disk exactly
what a compaction killed at that point leaves.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_elastic import events
from slurm_elastic.events import compact, read_events

ROOT = Path(__file__).resolve().parents[2]
EMIT = """
import os, sys
from slurm_elastic import events
print(os.getpid(), flush=True)
for step in range(int(sys.argv[1])):
    events.emit(events.TrainStart(step=step, world_size=1, rank=0))
if len(sys.argv) > 2:
    print("emitted", flush=True)
    sys.stdin.readline()  # alive until the test closes stdin
"""


def child_env(directory: Path, node: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        events.EVENTS_DIR_ENV: str(directory),
        "SLURMD_NODENAME": node,
        "SLURM_ELASTIC_RUN_ID": "r1",
    }


def gone_writer(directory: Path, node: str = "n1", count: int = 3) -> int:
    """A process of ``node`` that wrote ``count`` events and exited; its pid."""
    proc = subprocess.run(
        [sys.executable, "-c", EMIT, str(count)],
        env=child_env(directory, node),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(proc.stdout.split()[0])


def keyed(directory: Path) -> list[tuple[int, int]]:
    return sorted((e.pid, e["step"]) for e in read_events(directory))


@pytest.fixture
def events_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "events"
    directory.mkdir(mode=0o700)
    return directory


def test_gone_processes_are_merged_the_live_one_kept_and_every_event_read_once(
    events_dir: Path,
) -> None:
    gone = [gone_writer(events_dir) for _ in range(4)]
    live = subprocess.Popen(
        [sys.executable, "-c", EMIT, "2", "hold"],
        env=child_env(events_dir, "n1"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert live.stdout is not None and int(live.stdout.readline()) == live.pid
        assert live.stdout.readline() == "emitted\n"
        other_node = gone_writer(events_dir, node="n2")  # not this node's to judge
        before = keyed(events_dir)
        assert len(before) == 4 * 3 + 2 + 3

        merged = compact(events_dir, host="n1")

        assert sorted(int(p.name.split(".")[1]) for p in merged) == sorted(gone)
        names = sorted(p.name for p in events_dir.glob("*.jsonl"))
        assert names == sorted(
            ["n1.archive.jsonl", f"n1.{live.pid}.jsonl", f"n2.{other_node}.jsonl"]
        )
        assert keyed(events_dir) == before
        assert compact(events_dir, host="n1") == []  # nothing new is gone
    finally:
        assert live.stdin is not None
        live.stdin.close()
        live.wait(60)
    # the live one is gone now: the next pass merges it, and the archive only grows
    compact(events_dir, host="n1")
    assert sorted(p.name for p in events_dir.glob("n1.*")) == ["n1.archive.jsonl"]
    assert keyed(events_dir) == before
    assert (events_dir / "n1.archive.jsonl").stat().st_mode & 0o777 == 0o600


def test_a_crash_before_the_removal_leaves_nothing_read_twice(events_dir: Path) -> None:
    pid = gone_writer(events_dir)
    source = events_dir / f"n1.{pid}.jsonl"
    content = source.read_bytes()
    before = keyed(events_dir)
    compact(events_dir, host="n1")
    # what a compaction killed between its flush and the removal leaves: the source too
    source.write_bytes(content)
    assert keyed(events_dir) == before
    compact(events_dir, host="n1")  # merged again: twice in the archive, read once
    archive = (events_dir / "n1.archive.jsonl").read_bytes()
    assert archive == content * 2
    assert keyed(events_dir) == before


def test_a_torn_append_is_ended_and_the_next_files_are_read_whole(
    events_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = gone_writer(events_dir)
    compact(events_dir, host="n1")
    archive = events_dir / "n1.archive.jsonl"
    with archive.open("ab") as fh:
        fh.write(b'{"v": 1, "kind": "train.st')  # a compaction killed mid-append
    second = gone_writer(events_dir)
    compact(events_dir, host="n1")
    got = keyed(events_dir)
    assert got == sorted([(first, s) for s in range(3)] + [(second, s) for s in range(3)])
    assert "skipping line 4" in caplog.text  # the torn line: one malformed line, said


def test_a_torn_last_line_of_a_gone_process_is_not_merged(events_dir: Path) -> None:
    pid = gone_writer(events_dir, count=2)
    with (events_dir / f"n1.{pid}.jsonl").open("ab") as fh:
        fh.write(b'{"v": 1, "kind": "train.start", "ti')  # killed mid-write
    compact(events_dir, host="n1")
    archive = (events_dir / "n1.archive.jsonl").read_bytes()
    assert archive.count(b"\n") == 2 and archive.endswith(b"\n")
    assert len(keyed(events_dir)) == 2


def test_a_link_at_a_process_file_name_is_neither_followed_nor_removed(
    events_dir: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "someone-elses.jsonl"
    outside.write_text('{"v": 1, "kind": "train.start", "time": 1.0}\n')
    link = events_dir / "n1.999999.jsonl"  # a pid that does not run
    link.symlink_to(outside)
    assert compact(events_dir, host="n1") == []
    assert link.is_symlink() and outside.read_text().count("\n") == 1
    assert not (events_dir / "n1.archive.jsonl").read_bytes()


def test_another_compaction_of_the_node_holds_the_lock_nothing_is_merged(
    events_dir: Path,
) -> None:
    pid = gone_writer(events_dir)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
            "fcntl.lockf(fd, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "sys.stdin.readline()\n",
            str(events_dir / ".n1.lock"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert compact(events_dir, host="n1") == []
        assert (events_dir / f"n1.{pid}.jsonl").exists()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(60)
    assert [p.name for p in compact(events_dir, host="n1")] == [f"n1.{pid}.jsonl"]


def test_without_a_sink_compaction_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(events.EVENTS_DIR_ENV, raising=False)
    assert compact() == []


def test_a_file_merged_while_a_reader_lists_the_directory_is_not_missed(
    events_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The timing is forced (a compaction runs right after the reader listed the files,
    # before it opens the first); the compaction and the reading are the real ones.
    from slurm_elastic.events import reader

    pid = gone_writer(events_dir)
    before = keyed(events_dir)
    real_open = reader._open_events_file
    raced: list[Path] = []

    def open_after_a_compaction(path: Path):  # type: ignore[no-untyped-def]
        if not raced:
            raced.extend(compact(events_dir, host="n1"))
        return real_open(path)

    monkeypatch.setattr(reader, "_open_events_file", open_after_a_compaction)
    assert keyed(events_dir) == before
    assert [p.name for p in raced] == [f"n1.{pid}.jsonl"]


def test_an_events_directory_others_can_write_is_not_touched(events_dir: Path) -> None:
    pid = gone_writer(events_dir)
    events_dir.chmod(0o777)  # not the private directory the writers created
    try:
        assert compact(events_dir, host="n1") == []
        assert (events_dir / f"n1.{pid}.jsonl").exists()
        assert not (events_dir / "n1.archive.jsonl").exists()
    finally:
        events_dir.chmod(0o700)
