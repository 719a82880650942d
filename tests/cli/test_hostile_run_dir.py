"""status, logs and timeline on a hostile or damaged run directory (issue #21 item 6).

A neighbour who can write into a run's directory, or a damaged filesystem, must not make
the CLI print files from outside the run (``/etc/shadow`` when run as root), hang on a
FIFO, run out of memory on a huge or endless file, crash on one bad record, or drive the
terminal with escape sequences. Each case runs the real program
(``python -m slurm_elastic.cli.main``) on a copy of the recorded run, with a deadline and,
where memory is the point, an address-space limit far below the file's size.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN = "local-8f6892ca29"
DEADLINE_S = 60
#: Address space for the memory cases: the CLI needs well under it, the files are far over.
MEMORY_LIMIT = 768 << 20
GiB = 1 << 30


def _cli(*argv: str, memory: int | None = None) -> subprocess.CompletedProcess[bytes]:
    """Run ``slurm-elastic ARGV`` as its own process (bytes out, to see raw escapes)."""

    def limit() -> None:
        if memory is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("SLURM_ELASTIC_LOG_LEVEL", None)
    return subprocess.run(
        [sys.executable, "-m", "slurm_elastic.cli.main", *argv],
        capture_output=True,
        timeout=DEADLINE_S,  # a hang fails the test instead of stalling the suite
        env=env,
        preexec_fn=limit,
        cwd=REPO,
    )


def _events(state: Path, pid: int) -> Path:
    return state / "events" / RUN / f"vm.{pid}.jsonl"


def _rank0_first_log(state: Path) -> Path:
    """The stdout file of rank 0's first round (node vm:17527, attempt #1)."""
    return state / "logs" / RUN / f"{RUN}_9c6wkznk" / "attempt_0" / "0" / "stdout.log"


def _insert(path: Path, record: dict[str, object] | str, line_no: int) -> None:
    """Put ``record`` (a JSON object, or a raw line) at line ``line_no`` of ``path``."""
    lines = path.read_text().splitlines(keepends=True)
    text = record if isinstance(record, str) else json.dumps(record)
    lines.insert(line_no - 1, text + "\n")
    path.write_text("".join(lines))


def _assert_rank0_last_round_printed(out: bytes) -> None:
    assert b"[vm:17527 rank 0 #3] step 300 loss" in out, out[-2000:]


# -- logs: files outside the run, FIFOs, endless and huge files --------------------------


@pytest.mark.parametrize("how", ["symlink", "named"])
def test_logs_prints_no_file_from_outside_the_run_directory(
    recorded_run: Path, tmp_path: Path, how: str
) -> None:
    secret = tmp_path / "shadow"
    secret.write_text("root:TOPSECRET:19000:0:99999:7:::\n")
    log = _rank0_first_log(recorded_run)
    if how == "symlink":  # a link planted where the worker's log was
        log.unlink()
        log.symlink_to(secret)
        refused = log
    else:  # the event itself names a file outside the run
        events = _events(recorded_run, 17527)
        events.write_text(events.read_text().replace(str(log), str(secret)))
        refused = secret.with_name("stdout.log")  # logs reads stdout.log next to it
        refused.write_text("root:TOPSECRET:19000:0:99999:7:::\n")
    proc = _cli("logs", str(recorded_run))
    assert proc.returncode == 0, proc.stderr
    assert b"TOPSECRET" not in proc.stdout + proc.stderr
    _assert_rank0_last_round_printed(proc.stdout)
    err = proc.stderr.decode()
    assert str(refused) in err and "outside the run directory" in err, err


def test_logs_refuses_a_fifo_instead_of_hanging(recorded_run: Path) -> None:
    log = _rank0_first_log(recorded_run)
    log.unlink()
    os.mkfifo(log)  # nobody ever writes: opening it for reading blocks forever
    proc = _cli("logs", str(recorded_run))
    assert proc.returncode == 0, proc.stderr
    _assert_rank0_last_round_printed(proc.stdout)
    err = proc.stderr.decode()
    assert str(log) in err and "not a regular file (a FIFO)" in err, err


def test_logs_never_reads_dev_zero_through_a_worker_log(recorded_run: Path) -> None:
    log = _rank0_first_log(recorded_run)
    log.unlink()
    log.symlink_to("/dev/zero")  # endless: read whole, it never ends (or runs out of memory)
    proc = _cli("logs", str(recorded_run), memory=MEMORY_LIMIT)
    assert proc.returncode == 0, proc.stderr
    _assert_rank0_last_round_printed(proc.stdout)
    assert b"\\x00" not in proc.stdout and b"\x00" not in proc.stdout
    assert str(log) in proc.stderr.decode()


def test_logs_refuses_node_output_files_that_are_devices_links_or_fifos(tmp_path: Path) -> None:
    """A local job's folder: no worker logs named, so ``logs`` reads its node*.log files."""
    job = tmp_path / "job"
    events = job / "state" / "events" / "local-1"
    events.mkdir(parents=True)
    (job / "spec.json").write_text("{}")
    start = {"kind": "agent.start", "time": 1.0, "host": "h", "pid": 1, "run_id": "local-1"}
    (events / "h.1.jsonl").write_text(json.dumps(start) + "\n")
    (job / "node0.log").symlink_to("/dev/zero")
    os.mkfifo(job / "node1.log")
    (job / "node2.log").write_text("a real line\n")
    proc = _cli("logs", str(job), memory=MEMORY_LIMIT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == b"[node2] a real line\n"
    err = proc.stderr.decode()
    assert str(job / "node0.log") in err and str(job / "node1.log") in err, err


def test_logs_of_a_4gib_log_prints_its_tail_in_bounded_memory(recorded_run: Path) -> None:
    log = _rank0_first_log(recorded_run)
    with open(log, "r+b") as fh:  # sparse: 4 GiB of zeros cost no disk
        fh.truncate(4 * GiB)
        fh.seek(0, os.SEEK_END)
        fh.write(b"\nthe very last line\n")
    proc = _cli("logs", str(recorded_run), "--rank", "0", memory=MEMORY_LIMIT)
    assert proc.returncode == 0, proc.stderr
    assert b"[vm:17527 rank 0 #1] the very last line\n" in proc.stdout
    _assert_rank0_last_round_printed(proc.stdout)
    err = proc.stderr.decode()
    assert str(log) in err and "showing its last" in err, err


def test_logs_cuts_an_endless_line_and_goes_on(recorded_run: Path) -> None:
    log = _rank0_first_log(recorded_run)
    log.write_bytes(b"x" * (8 << 20) + b"\nafter the long line\n")  # 8 MiB, no newline
    proc = _cli("logs", str(recorded_run), "--rank", "0", memory=MEMORY_LIMIT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    long = [ln for ln in lines if ln.startswith(b"[vm:17527 rank 0 #1] xxx")]
    assert len(long) == 1 and len(long[0]) < 100_000 and b"line cut" in long[0]
    assert b"[vm:17527 rank 0 #1] after the long line" in lines


# -- events files: huge, FIFOs --------------------------------------------------------------


def test_status_reads_a_3gib_events_file_in_bounded_memory(recorded_run: Path) -> None:
    huge = _events(recorded_run, 55555)
    with open(huge, "wb") as fh:  # sparse
        fh.truncate(3 * GiB)
        fh.seek(0, os.SEEK_END)
        record = {"kind": "train.progress", "time": 1796077500.0, "host": "vm", "pid": 55555}
        fh.write(json.dumps({**record, "step": 300, "rank": 0}).encode() + b"\n")
    proc = _cli("status", str(recorded_run), memory=MEMORY_LIMIT)
    assert proc.returncode == 0, proc.stderr
    assert b"run local-8f6892ca29   state COMPLETED" in proc.stdout
    err = proc.stderr.decode()
    assert str(huge) in err, err


def test_status_skips_a_fifo_named_like_an_events_file(recorded_run: Path) -> None:
    fifo = _events(recorded_run, 44444)
    os.mkfifo(fifo)
    for verb in ("status", "logs"):
        proc = _cli(verb, str(recorded_run))
        assert proc.returncode == 0, proc.stderr
        err = proc.stderr.decode()
        assert str(fifo) in err and "not a regular file" in err, err


# -- one bad record ------------------------------------------------------------------------

_BASE = {"v": 1, "time": 1796077520.0, "host": "vm", "pid": 17527, "run_id": RUN}
_MALFORMED = {
    "step a string": {**_BASE, "kind": "checkpoint.saved", "step": "300", "path": "p"},
    "log path a number": {**_BASE, "kind": "agent.workers_started", "logs": {"0": 5}},
    "infinite time": '{"kind": "train.progress", "time": Infinity, "host": "vm", "pid": 1}',
    "5000-digit step": '{"kind": "train.done", "time": 1.0, "step": 1' + "0" * 5000 + "}",
    "nested 100000 deep": '{"kind": "agent.exit", "time": 1.0, "x": ' + "[" * 100_000 + "}",
    "bool world size": {**_BASE, "kind": "agent.workers_started", "group_world_size": True},
    "config not a mapping": {**_BASE, "kind": "agent.start", "config": ["rdzv_endpoint"]},
}


@pytest.mark.parametrize("record", list(_MALFORMED.values()), ids=list(_MALFORMED))
def test_one_malformed_record_is_skipped_with_a_warning_naming_file_and_line(
    recorded_run: Path, tmp_path: Path, record: dict[str, object] | str
) -> None:
    events = _events(recorded_run, 17527)
    _insert(events, record, 3)
    for argv in (
        ["status", str(recorded_run)],
        ["status", str(recorded_run), "--json"],
        ["logs", str(recorded_run)],
        ["timeline", str(recorded_run), "-o", str(tmp_path / "t.png")],
    ):
        proc = _cli(*argv)
        err = proc.stderr.decode()
        assert proc.returncode == 0, f"{argv}: {err}"
        assert "internal error" not in err
        assert f"line 3 of {str(events)!r}" in err, f"{argv}: {err}"
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_a_log_entry_with_no_rank_number_is_skipped_with_a_warning(recorded_run: Path) -> None:
    events = _events(recorded_run, 17527)
    bad = {**_BASE, "kind": "agent.workers_started", "logs": {"zero": "/x/stdout.log"}}
    _insert(events, bad, 3)
    proc = _cli("logs", str(recorded_run))
    assert proc.returncode == 0, proc.stderr
    _assert_rank0_last_round_printed(proc.stdout)
    err = proc.stderr.decode()
    assert "'zero'" in err and str(events) in err, err


# -- what reaches the terminal ---------------------------------------------------------------

_ESC_HOST = "vm\x1b]0;owned\x07\x1b[2J\r\x9b31m"


def test_escape_sequences_in_events_and_logs_are_printed_escaped(recorded_run: Path) -> None:
    for path in (recorded_run / "events" / RUN).glob("*.jsonl"):
        path.write_text(
            path.read_text().replace('"host": "vm"', f'"host": {json.dumps(_ESC_HOST)}')
        )
    log = _rank0_first_log(recorded_run)
    log.write_bytes(b"clear \x1b[2J\x1b[H title \x1b]0;pwned\x07 back\rover \xc2\x9b1m\r\n")
    for verb in ("status", "logs"):
        proc = _cli(verb, str(recorded_run))
        assert proc.returncode == 0, proc.stderr
        shown = proc.stdout + proc.stderr
        for raw in (b"\x1b", b"\x07", b"\r", b"\xc2\x9b"):
            assert raw not in shown, (verb, raw, shown[:3000])
        assert b"vm\\x1b]0;owned\\x07\\x1b[2J\\x0d\\x9b31m" in proc.stdout, proc.stdout[:3000]
    assert b"clear \\x1b[2J\\x1b[H title \\x1b]0;pwned\\x07 back\\x0dover \\x9b1m\n" in proc.stdout


def test_timeline_draws_host_names_with_dollar_signs_literally(
    recorded_run: Path, tmp_path: Path
) -> None:
    events = _events(recorded_run, 17527)
    events.write_text(events.read_text().replace('"host": "vm"', '"host": "a$\\\\undefined{$b"'))
    proc = _cli("timeline", str(recorded_run), "-o", str(tmp_path / "t.png"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_timeline_of_an_absurd_world_size_does_not_draw_a_tick_per_node(
    recorded_run: Path, tmp_path: Path
) -> None:
    events = _events(recorded_run, 17527)
    huge = {**_BASE, "kind": "agent.workers_started", "group_world_size": 10**15}
    _insert(events, huge, 3)
    proc = _cli("timeline", str(recorded_run), "-o", str(tmp_path / "t.png"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_logs_in_a_configured_log_dir_outside_the_state_dir_are_read_via_the_run_index(
    recorded_run: Path, tmp_path: Path
) -> None:
    """``log_dir`` set elsewhere: the (private) run index names it, so it is the run's too."""
    from slurm_elastic import events as ev

    elsewhere = tmp_path / "scratch" / "logs"
    elsewhere.parent.mkdir()
    (recorded_run / "logs").rename(elsewhere)
    for path in (recorded_run / "events" / RUN).glob("*.jsonl"):
        path.write_text(path.read_text().replace(str(recorded_run / "logs"), str(elsewhere)))
    proc = _cli("logs", str(recorded_run))  # no index entry: outside the run directory
    assert b"[vm:17527 rank 0 #3] step 300 loss" not in proc.stdout
    assert "outside the run directory" in proc.stderr.decode()
    ev.record_run(
        RUN,
        state_dir=recorded_run,
        events_dir=recorded_run / "events" / RUN,
        log_dir=elsewhere,
    )
    for job in (RUN, str(recorded_run)):
        proc = _cli("logs", job)
        assert proc.returncode == 0 and b"skipping log" not in proc.stderr, proc.stderr
        _assert_rank0_last_round_printed(proc.stdout)
