"""The node's channel files as hostile input (issue 21, item 7).

Any process of the job's user can write the node directory, so every reader must
survive a damaged or crafted file: non-finite or out-of-range numbers, bools where ints
belong, FIFOs, directories and links named like channel files, oversized files. Each
is ignored with a warning naming the file (rate-limited), never raised or blocked on.

Everything here is real: files and FIFOs (``os.mkfifo``) on disk, the real readers, the
worker's real :class:`AssignmentWatch.poll`, the agent's real registration check and
hang watchdog. A read that could block runs in a thread with a deadline; on a regression
the test opens the FIFO at both ends to release the thread, then fails.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import pytest

from slurm_elastic import channel, notice
from slurm_elastic.agent.watchdog import ProgressWatch
from slurm_elastic.channel import NodeChannel
from slurm_elastic.live import roster

T = TypeVar("T")

DEADLINE_S = 10.0

GOOD = roster.Assignment(
    round=4,
    rank=2,
    world_size=4,
    local_rank=0,
    group_rank=1,
    group_world_size=2,
    master_addr="127.0.0.1",
    master_port=29500,
)
INT_FIELDS = ["round", "rank", "world_size", "local_rank", "group_rank", "group_world_size"]
BAD_NUMBERS = [
    "Infinity",
    "-Infinity",
    "NaN",
    "1e400",  # a float literal that parses to inf
    "1" + "0" * 30,  # a huge int
    "-1",
    "true",
    "5.0",
    '"5"',
]


def without_blocking(call: Callable[[], T], fifo: Path) -> T:
    """``call()``, failing the test if it is still blocked after :data:`DEADLINE_S`."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    if thread.is_alive():
        # Opening both ends wakes a reader or writer blocked in open(); closing gives the
        # reader EOF, so the thread ends instead of outliving the test.
        os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
        thread.join(DEADLINE_S)
        pytest.fail(f"blocked for {DEADLINE_S:.0f} s on the FIFO {fifo}")
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def warnings_about(caplog: pytest.LogCaptureFixture, path: Path) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and str(path) in r.getMessage()
    ]


def crafted_assignment(field: str, literal: str) -> str:
    """GOOD as JSON text with ``field``'s value replaced by ``literal`` verbatim."""
    data = GOOD.as_dict()
    data[field] = "@@"
    return json.dumps(data).replace('"@@"', literal)


# -- assignments: the worker's poll -----------------------------------------------------------


@pytest.mark.parametrize("literal", BAD_NUMBERS)
@pytest.mark.parametrize("field", [*INT_FIELDS, "master_port"])
def test_bad_number_in_an_assignment_is_ignored_by_the_workers_poll_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, field: str, literal: str
) -> None:
    # Before: "round": Infinity raised OverflowError out of poll(); a huge int, true,
    # 5.0 or "5" was taken as an assignment; the others were dropped without a word.
    path = tmp_path / "assign.0"
    path.write_text(crafted_assignment(field, literal))
    watch = roster.AssignmentWatch(NodeChannel(tmp_path), 0, current_round=0, min_interval_s=0)
    assert watch.poll(force=True) is None
    assert roster.read_assignment(NodeChannel(tmp_path), 0) is None
    assert warnings_about(caplog, path), caplog.text


def test_the_workers_poll_takes_a_good_assignment_after_a_bad_one(tmp_path: Path) -> None:
    (tmp_path / "assign.0").write_text(crafted_assignment("round", "Infinity"))
    watch = roster.AssignmentWatch(NodeChannel(tmp_path), 0, current_round=0, min_interval_s=0)
    assert watch.poll(force=True) is None
    roster.write_assignment(NodeChannel(tmp_path), GOOD)
    assert watch.poll(force=True) == GOOD


def test_fifo_named_like_an_assignment_does_not_block_the_workers_poll(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: read_text() waited forever for a writer.
    fifo = tmp_path / "assign.0"
    os.mkfifo(fifo)
    watch = roster.AssignmentWatch(NodeChannel(tmp_path), 0, current_round=0, min_interval_s=0)
    assert without_blocking(lambda: watch.poll(force=True), fifo) is None
    assert any("not a regular file" in m for m in warnings_about(caplog, fifo)), caplog.text


@pytest.mark.parametrize("kind", ["directory", "symlink", "symlink loop"])
def test_directory_or_link_named_like_an_assignment_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    # Before: a directory raised IsADirectoryError and a link loop ELOOP out of poll();
    # a link to a good assignment elsewhere was followed.
    path = tmp_path / "assign.0"
    if kind == "directory":
        path.mkdir()
    elif kind == "symlink":
        elsewhere = tmp_path / "elsewhere"
        roster.write_assignment(NodeChannel(elsewhere), GOOD)
        path.symlink_to(elsewhere / "assign.0")
    else:
        path.symlink_to(path.name)
    watch = roster.AssignmentWatch(NodeChannel(tmp_path), 0, current_round=0, min_interval_s=0)
    assert watch.poll(force=True) is None
    assert warnings_about(caplog, path), caplog.text


def test_oversized_assignment_is_refused_unread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Valid JSON padded past the bound: before, the whole file was read and accepted.
    path = tmp_path / "assign.0"
    path.write_text(json.dumps(GOOD.as_dict()) + " " * (1 << 20))  # 1 MiB of padding
    assert roster.read_assignment(NodeChannel(tmp_path), 0) is None
    assert any("more than" in m for m in warnings_about(caplog, path)), caplog.text
    assert roster.MAX_FILE_BYTES < 1 << 20


def test_deeply_nested_json_is_ignored_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: json's RecursionError escaped from the reader (it caught JSONDecodeError).
    path = tmp_path / "assign.0"
    path.write_text("[" * 50_000)  # under the size bound: the parser meets it
    assert roster.read_assignment(NodeChannel(tmp_path), 0) is None
    assert warnings_about(caplog, path), caplog.text


def test_assignment_for_another_local_rank_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: assign.0 holding local_rank 1 was handed to worker 0.
    path = tmp_path / "assign.0"
    data = {**GOOD.as_dict(), "local_rank": 1}
    path.write_text(json.dumps(data))
    assert roster.read_assignment(NodeChannel(tmp_path), 0) is None
    assert warnings_about(caplog, path), caplog.text


# -- registrations: the agent's monitor -------------------------------------------------------


def agent_sees_registered(node_dir: Path, pids: dict[int, int]) -> bool:
    """The agent's own check (``SlurmElasticAgent._workers_registered``), run on a
    stand-in holding only what the method reads: its workers and node channel."""
    from slurm_elastic.agent.elastic_agent import SlurmElasticAgent

    stand_in = SimpleNamespace(
        _worker_group=SimpleNamespace(
            workers=[SimpleNamespace(local_rank=r, id=pid) for r, pid in pids.items()]
        ),
        _channel=NodeChannel(node_dir),
    )
    return SlurmElasticAgent._workers_registered(stand_in)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "literal",
    ["Infinity", "-Infinity", "NaN", "1e400", "1" + "0" * 30, "-5", "0", "true", "1.5", '"111"'],
)
def test_bad_pid_in_a_registration_is_ignored_by_the_agent_with_a_warning(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    literal: str,
) -> None:
    # Before: "pid": Infinity raised OverflowError out of the agent's monitor; a huge,
    # negative or zero pid, true, 1.5 or "111" counted as a registration.
    monkeypatch.delenv(roster.IN_PLACE_ENV, raising=False)
    roster.register_worker(NodeChannel(tmp_path), 1, 222)
    path = tmp_path / "worker.0"
    path.write_text(f'{{"pid": {literal}, "live": true}}')
    assert roster.registered_workers(NodeChannel(tmp_path)) == {1: 222}
    assert not agent_sees_registered(tmp_path, {0: 111, 1: 222})
    assert warnings_about(caplog, path), caplog.text


def test_fifo_named_like_a_registration_does_not_block_the_agent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(roster.IN_PLACE_ENV, raising=False)
    roster.register_worker(NodeChannel(tmp_path), 1, 222)
    fifo = tmp_path / "worker.0"
    os.mkfifo(fifo)
    assert without_blocking(lambda: roster.registered_workers(NodeChannel(tmp_path)), fifo) == {
        1: 222
    }
    assert not without_blocking(lambda: agent_sees_registered(tmp_path, {0: 1, 1: 222}), fifo)
    assert warnings_about(caplog, fifo), caplog.text


def test_directory_named_like_a_registration_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: IsADirectoryError out of registered_workers().
    roster.register_worker(NodeChannel(tmp_path), 1, 222)
    (tmp_path / "worker.0").mkdir()
    (tmp_path / "worker.x").write_text('{"pid": 5, "live": true}')
    assert roster.registered_workers(NodeChannel(tmp_path)) == {1: 222}
    assert warnings_about(caplog, tmp_path / "worker.0"), caplog.text
    assert warnings_about(caplog, tmp_path / "worker.x"), caplog.text


PID_MARKS = {  # prefix -> (writer, reader)
    "restart.": (roster.mark_restart_path, roster.restart_path_pid),
    "closed.": (roster.mark_closed, roster.closed_pid),
}


@pytest.mark.parametrize("prefix", sorted(PID_MARKS))
@pytest.mark.parametrize("literal", ["Infinity", "NaN", "-5", "0", "true", "1.5", '"111"'])
def test_bad_pid_in_a_pid_mark_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, literal: str, prefix: str
) -> None:
    write, read = PID_MARKS[prefix]
    write(NodeChannel(tmp_path), 1, 222)
    path = tmp_path / f"{prefix}0"
    path.write_text(f'{{"pid": {literal}}}')
    assert read(NodeChannel(tmp_path), 0) is None
    assert read(NodeChannel(tmp_path), 1) == 222
    assert warnings_about(caplog, path), caplog.text


def test_fifo_or_directory_named_like_a_restart_path_mark_is_no_mark(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fifo = tmp_path / "restart.0"
    os.mkfifo(fifo)
    (tmp_path / "restart.1").mkdir()
    assert without_blocking(lambda: roster.restart_path_pid(NodeChannel(tmp_path), 0), fifo) is None
    assert roster.restart_path_pid(NodeChannel(tmp_path), 1) is None
    assert warnings_about(caplog, fifo), caplog.text


def test_a_bad_file_met_in_a_poll_loop_is_warned_about_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "worker.0"
    path.write_text('{"pid": Infinity, "live": true}')
    for _ in range(50):
        assert roster.registered_workers(NodeChannel(tmp_path)) == {}
    assert len(warnings_about(caplog, path)) == 1, caplog.text
    # Once the interval has passed, the next warning counts what was held back.
    monkeypatch.setattr(channel, "IGNORED_WARNING_INTERVAL_S", 0.0)
    roster.registered_workers(NodeChannel(tmp_path))
    messages = warnings_about(caplog, path)
    assert len(messages) == 2
    assert "(49 similar warnings suppressed)" in messages[1]


def test_clear_survives_a_directory_named_like_a_control_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: IsADirectoryError out of clear(), i.e. out of the agent's round start.
    roster.register_worker(NodeChannel(tmp_path), 1, 222)
    (tmp_path / "assign.0").mkdir()
    NodeChannel(tmp_path).clear()
    assert not (tmp_path / "worker.1").exists()
    assert warnings_about(caplog, tmp_path / "assign.0"), caplog.text


# -- writers: crash-safe and never blocked -------------------------------------------------


def test_fifo_at_the_temporary_name_does_not_block_a_registration(tmp_path: Path) -> None:
    # Before: the temporary file was opened O_WRONLY without O_EXCL: a FIFO there blocked
    # register_worker() (and write_assignment(), the same writer) until a reader came.
    fifo = tmp_path / f".worker.0.{os.getpid()}.tmp"
    os.mkfifo(fifo)
    without_blocking(lambda: roster.register_worker(NodeChannel(tmp_path), 0, 111), fifo)
    assert roster.registered_workers(NodeChannel(tmp_path)) == {0: 111}
    assert not fifo.exists()  # renamed into place: the writer made its own file


# -- the heartbeat: the agent's hang watchdog ------------------------------------------------


def test_fifo_as_heartbeat_neither_blocks_the_watchdog_nor_passes_for_progress(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: ProgressWatch.age_s() (the agent's monitor, every tick) blocked in open().
    path = tmp_path / "progress"
    now = [0.0]
    watch = ProgressWatch(path, clock=lambda: now[0])
    notice.report_progress(1, path=path, force=True)
    assert watch.age_s() == 0.0  # armed by a real report
    path.unlink()
    os.mkfifo(path)
    now[0] = 5.0
    assert without_blocking(watch.age_s, path) == pytest.approx(5.0)  # no progress
    assert warnings_about(caplog, path), caplog.text


def test_fifo_as_heartbeat_does_not_block_last_progress(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fifo = tmp_path / "progress"
    os.mkfifo(fifo)
    assert without_blocking(lambda: notice.last_progress(fifo), fifo) is None
    assert warnings_about(caplog, fifo), caplog.text


def test_directory_as_heartbeat_is_no_report(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: IsADirectoryError out of last_progress().
    path = tmp_path / "progress"
    path.mkdir()
    assert notice.last_progress(path) is None
    assert warnings_about(caplog, path), caplog.text


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_heartbeat_time_that_is_not_finite_reads_as_unparsable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, value: str
) -> None:
    # Before: Progress(7, inf) was returned as a real report.
    path = tmp_path / "progress"
    path.write_text(f"{7:20d} {value:>20}\n")
    assert len(path.read_bytes()) == 42  # the writer's line length: only the value is bad
    got = notice.last_progress(path)
    assert got == (-1, pytest.approx(path.stat().st_mtime))
    assert warnings_about(caplog, path), caplog.text


def test_fifo_as_heartbeat_does_not_block_the_workers_report(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: report_progress() opened the FIFO O_WRONLY and waited for a reader, inside
    # the training loop.
    fifo = tmp_path / "progress"
    os.mkfifo(fifo)
    assert without_blocking(lambda: notice.report_progress(1, path=fifo, force=True), fifo) is False
    assert warnings_about(caplog, fifo), caplog.text


# -- the notice file ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_something_other_than_a_file_at_the_notice_name_is_no_notice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    # Before: anything at the name (os.path.exists) was a notice. The agent's notice is
    # always a regular file (renamed into place); preemption_requested() shares the check.
    node = NodeChannel(tmp_path)
    path = node.notice
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    assert not notice.notice_raised(node)
    node.clear()  # before: IsADirectoryError out of the agent's round start
    assert warnings_about(caplog, path), caplog.text
    if kind == "fifo":
        notice.raise_notice(node, reason="stop")  # the agent's rename replaces the FIFO
        assert notice.notice_raised(node)


def test_fifo_at_the_temporary_name_does_not_block_raising_a_notice(tmp_path: Path) -> None:
    # Before: raise_notice() wrote its temporary file with write_text(), which opened a
    # FIFO planted there and waited for a reader: the agent's signal handler hung.
    node = NodeChannel(tmp_path)
    path = node.notice
    fifo = tmp_path / f".notice.{os.getpid()}.tmp"
    os.mkfifo(fifo)
    without_blocking(lambda: notice.raise_notice(node, reason="stop"), fifo)
    assert notice.notice_raised(node)
    assert path.read_text().startswith("stop ")
