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
from slurm_elastic.channel import NodeChannel
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
    node = NodeChannel(tmp_path / "node")
    proc, out = _start_worker(tmp_path, **node.environment())
    time.sleep(0.1)  # a few steps without notice: the worker must keep running
    assert proc.poll() is None
    notice.raise_notice(node, reason="stop")
    assert _finish(proc) == 0
    assert out.exists()
    assert notice.notice_raised(node)
    assert node.notice.read_text().startswith("stop ")
    node.clear()
    assert not notice.notice_raised(node)
    node.clear()  # idempotent


def test_heartbeat_of_real_worker_advances_and_agent_reads_it(tmp_path: Path) -> None:
    node = NodeChannel(tmp_path / "node")
    hb = node.progress
    proc, _ = _start_worker(tmp_path, **node.environment())
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
    monkeypatch.delenv(notice.NODE_DIR_ENV, raising=False)
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


# Slurm signals every process of a step when the notice is not batch-only (issue #22
# item 8): a training script's helper processes (DataLoader workers) get it too.
FORK_HELPER = textwrap.dedent(
    """
    import os, signal, sys
    from slurm_elastic import notice
    if sys.argv[1] == "own":
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # the script's own choice: kept
    got = notice.ensure_preemption_handler()
    print(got.name if got else None, signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a forked helper (a DataLoader worker): inherits the disposition
        os.close(w)
        os.read(r, 1)  # alive until the parent has signalled it and says go
        os._exit(0)
    os.close(r)
    os.kill(pid, signal.SIGUSR2)
    try:
        os.write(w, b"x")  # a helper the signal killed never reads this
    except BrokenPipeError:
        pass
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
    """
)


@pytest.mark.parametrize(("mode", "handled", "ignored"), [("new", "SIGUSR2", "False"),
                                                          ("own", "None", "True")])  # fmt: skip
def test_ensure_handler_before_a_fork_keeps_the_forked_helper_alive(
    mode: str, handled: str, ignored: str
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", FORK_HELPER, mode],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=True,
    ).stdout.split()
    assert out == [handled, ignored, "0"], out  # 0: the helper exited by itself, not -12


FRESH_HELPER = textwrap.dedent(
    """
    import os, signal
    from slurm_elastic import notice
    notice.loader_worker_init(0)
    print(signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN, flush=True)
    os.kill(os.getpid(), signal.SIGUSR2)
    print("alive", flush=True)
    """
)


@pytest.mark.parametrize("name", ["USR2", "USR1"])
def test_loader_worker_init_makes_a_fresh_helper_ignore_the_notice(name: str) -> None:
    # A spawn/forkserver DataLoader worker starts with the default action (terminate).
    proc = subprocess.run(
        [sys.executable, "-c", FRESH_HELPER.replace("SIGUSR2", f"SIG{name}")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SLURM_ELASTIC_PREEMPT_SIGNAL": name},
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.split() == ["True", "alive"], proc


def test_loader_worker_init_leaves_a_term_notice_alone() -> None:
    # SIGTERM must still end a loader worker (torch's workers handle it themselves).
    script = "import signal; from slurm_elastic import notice; notice.loader_worker_init(0); "
    script += "print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SLURM_ELASTIC_PREEMPT_SIGNAL": "TERM"},
        check=True,
    )
    assert proc.stdout.split() == ["True"], proc
