"""Worker-side preemption notice and progress heartbeat (slurm_elastic.notice).

Signals are real: delivered with os.kill to a real Python subprocess that runs a small
training-like loop, exactly as the agent will deliver them to its workers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from slurm_elastic import notice
from slurm_elastic.errors import ConfigError
from tests.helpers import wait_for

# A worker loop: each step "works" for 20 ms (a sleep that a signal must not break), then
# reports progress and checks the notice at the step boundary; on notice it writes the last
# completed step (the "checkpoint") and exits 0.
WORKER = textwrap.dedent(
    """
    import os, sys, time
    from slurm_elastic import notice
    if os.environ.get("INSTALL") == "1":
        notice.install_preemption_handler()
    out = sys.argv[1]
    step = 0
    while step < 100000:
        started = step
        time.sleep(0.02)          # the step's work
        step += 1
        notice.report_progress(step)
        if notice.preemption_requested():
            with open(out, "w") as fh:
                fh.write(f"{step} {started}")
            sys.exit(0)
        if step == 1:
            print("ready", flush=True)
    sys.exit(3)
    """
)


def _start_worker(tmp_path: Path, **env: str) -> tuple[subprocess.Popen[str], Path]:
    out = tmp_path / "checkpoint.txt"
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(out)],
        env=full_env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc, out


def _finish(proc: subprocess.Popen[str], timeout: float = 20) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigusr2_to_worker_with_installed_handler_stops_at_step_boundary(tmp_path: Path) -> None:
    proc, out = _start_worker(tmp_path, INSTALL="1")
    os.kill(proc.pid, signal.SIGUSR2)
    assert _finish(proc) == 0, "worker should leave cleanly, not die of SIGUSR2"
    step, started = map(int, out.read_text().split())
    assert step == started + 1, "the checkpointed step must be a completed one"


def test_first_preemption_check_installs_handler_so_sigusr2_does_not_kill(
    tmp_path: Path,
) -> None:
    # INSTALL unset: only preemption_requested() is called, which installs lazily.
    proc, out = _start_worker(tmp_path)
    os.kill(proc.pid, signal.SIGUSR2)
    assert _finish(proc) == 0
    assert out.exists()


def test_preempt_signal_is_configurable_through_env(tmp_path: Path) -> None:
    proc, out = _start_worker(tmp_path, INSTALL="1", SLURM_ELASTIC_PREEMPT_SIGNAL="USR1")
    os.kill(proc.pid, signal.SIGUSR1)
    assert _finish(proc) == 0
    assert out.exists()


def test_unhandled_other_signal_still_kills_worker(tmp_path: Path) -> None:
    # Sanity check of the test itself: USR1 is not handled when USR2 is configured,
    # so the default action (terminate) applies and no checkpoint is written.
    proc, out = _start_worker(tmp_path, INSTALL="1")
    os.kill(proc.pid, signal.SIGUSR1)
    assert _finish(proc) == -signal.SIGUSR1
    assert not out.exists()


def test_notice_file_raised_by_agent_is_seen_without_a_signal(tmp_path: Path) -> None:
    notice_file = tmp_path / "node" / "notice"
    proc, out = _start_worker(tmp_path, SLURM_ELASTIC_NOTICE_FILE=str(notice_file))
    time.sleep(0.1)  # a few steps without notice: the worker must keep running
    assert proc.poll() is None
    notice.raise_notice(notice_file, reason="stop")
    assert _finish(proc) == 0
    assert out.exists()
    assert notice.notice_raised(notice_file)
    assert notice_file.read_text().startswith("stop ")
    notice.clear_notice(notice_file)
    assert not notice.notice_raised(notice_file)
    notice.clear_notice(notice_file)  # idempotent


def test_heartbeat_of_real_worker_advances_and_agent_reads_it(tmp_path: Path) -> None:
    hb = tmp_path / "hb"
    proc, _ = _start_worker(tmp_path, SLURM_ELASTIC_HEARTBEAT_FILE=str(hb))
    try:
        first = wait_for(lambda: notice.last_progress(hb), 10, "first heartbeat")
        assert first.step >= 1
        later = wait_for(
            lambda: (p := notice.last_progress(hb)) is not None and p.step > first.step and p,
            10,
            "heartbeat to advance",
        )
        assert later.time >= first.time
        assert abs(later.time - time.time()) < 5
    finally:
        os.kill(proc.pid, signal.SIGUSR2)
        _finish(proc)


def test_report_progress_is_rate_limited_and_force_writes(tmp_path: Path) -> None:
    hb = tmp_path / "sub" / "hb"
    assert notice.report_progress(1, path=hb, force=True)
    assert notice.last_progress(hb) == (1, pytest.approx(time.time(), abs=5))
    # within PROGRESS_MIN_INTERVAL_S of the last write: skipped, file keeps step 1
    assert not notice.report_progress(2, path=hb)
    assert notice.last_progress(hb).step == 1  # type: ignore[union-attr]
    assert notice.report_progress(3, path=hb, force=True)
    assert notice.last_progress(hb).step == 3  # type: ignore[union-attr]
    wait_for(lambda: notice.report_progress(4, path=hb), 5, "rate limit to expire")
    assert notice.last_progress(hb).step == 4  # type: ignore[union-attr]


def test_report_progress_without_heartbeat_file_is_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(notice.HEARTBEAT_FILE_ENV, raising=False)
    notice.reload_environment()
    assert notice.report_progress(5) is False


def test_last_progress_missing_and_garbled(tmp_path: Path) -> None:
    assert notice.last_progress(tmp_path / "none") is None
    bad = tmp_path / "bad"
    bad.write_text("garbage\n")
    got = notice.last_progress(bad)
    assert got is not None
    assert got.step == -1
    assert got.time == pytest.approx(bad.stat().st_mtime)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("USR2", signal.SIGUSR2),
        ("sigusr1", signal.SIGUSR1),
        ("TERM", signal.SIGTERM),
        (12, signal.SIGUSR2),
        ("12", signal.SIGUSR2),
        (signal.SIGHUP, signal.SIGHUP),
    ],
)
def test_parse_signal_accepts_names_and_numbers(given: str | int, expected: signal.Signals) -> None:
    assert notice.parse_signal(given) == expected


def test_parse_signal_rejects_unknown_with_hint() -> None:
    with pytest.raises(ConfigError, match=r"'USR3' is not a known signal; use a name such as"):
        notice.parse_signal("USR3")
    with pytest.raises(ConfigError, match=r"999 is not a signal number"):
        notice.parse_signal(999)
