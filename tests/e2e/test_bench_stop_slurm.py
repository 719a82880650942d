"""A benchmark stopped by a signal leaves nothing behind: no job in the queue, no process,
no work directory.

Python's default SIGTERM ends a process without its ``finally`` blocks: the goodput and
start-up benches then left their Slurm jobs in the queue until their time limit (and the
goodput bench, which refuses to measure while other jobs hold nodes, refused every run
after it), and ``bench/all.py``, which runs each bench, killed a bench that ran out of time
with SIGKILL, so no clean-up of the bench ran either. Once stopped cleanly, the start-up
bench still left its work directory: it deleted it while its cancelled job's agents were
still writing their events into it; it now waits for the job to end first. The real
benches run here, from the checkout, on the real local cluster, and are stopped once their
job's processes write; the first tests are ``bench/all.py``'s pass-on with a stand-in
child (a real process whose own clean-up is what is watched).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from slurm_elastic.slurm.jobstate import JobInfo
from tests.conftest import SlurmCluster
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]


class _Bench:
    """A bench script in its own process; its output lines collected as they come."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, *argv],
            cwd=ROOT,
            env={**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def said(self, marker: str) -> str | None:
        """The rest of the first output line that contains ``marker``."""
        for line in list(self.lines):
            if marker in line:
                return line.split(marker, 1)[1].strip()
        return None

    def stop(self, timeout: float) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError("\n".join(self.lines[-30:])) from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def test_all_passes_a_stop_on_to_the_bench_it_runs(tmp_path: Path) -> None:
    # The stand-in bench: its own SIGTERM clean-up writes a file. bench/all.py's way to
    # run it (run_child), stopped by SIGTERM, must let that clean-up run.
    child = tmp_path / "child.py"
    child.write_text(
        textwrap.dedent(f"""
        import signal, sys, time
        from pathlib import Path
        def cleanup(*_):
            Path({str(tmp_path / "cleaned")!r}).write_text("yes")
            sys.exit(143)
        signal.signal(signal.SIGTERM, cleanup)
        Path({str(tmp_path / "started")!r}).write_text("yes")
        time.sleep(600)
        """)
    )
    runner = tmp_path / "runner.py"
    runner.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "bench")!r})
        from _stopping import run_child, stop_on_sigterm
        stop_on_sigterm()
        run_child([sys.executable, {str(child)!r}], timeout=600, grace=30)
        """)
    )
    bench = _Bench([str(runner)])
    try:
        wait_for(lambda: (tmp_path / "started").exists(), 60, "the child started")
        assert bench.stop(60) == 128 + signal.SIGTERM, bench.lines
        assert (tmp_path / "cleaned").read_text() == "yes"
    finally:
        bench.kill()


def test_a_child_out_of_time_gets_its_clean_up_too(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from _stopping import run_child
    finally:
        sys.path.remove(str(ROOT / "bench"))
    code = (
        "import signal, sys, time\n"
        "from pathlib import Path\n"
        "signal.signal(signal.SIGTERM, lambda *_: (Path(sys.argv[1]).write_text('yes'),"
        " sys.exit(143)))\n"
        "Path(sys.argv[2]).write_text('yes')\n"
        "time.sleep(600)\n"
    )
    started, cleaned = tmp_path / "started", tmp_path / "cleaned"
    with pytest.raises(subprocess.TimeoutExpired):
        # a timeout long enough for the child to reach its handler on a loaded machine
        run_child([sys.executable, "-c", code, str(cleaned), str(started)], timeout=20, grace=30)
    assert started.exists(), "the child did not start within the timeout"
    assert cleaned.read_text() == "yes"


def _new_jobs(cluster: SlurmCluster, before: set[str]) -> list[JobInfo]:
    return [i for i in cluster.client.queue() if i.job_id not in before]


def _stop_bench_with_a_job_running(
    cluster: SlurmCluster, argv: list[str], directory_marker: str, written: str
) -> None:
    """Start the bench, wait until its job runs and has written ``written`` (a pattern in
    its work directory: its processes write there until they end), stop it."""
    before = {i.job_id for i in cluster.client.queue()}
    bench = _Bench(argv, env=cluster.env)

    def queued() -> list[JobInfo]:
        if bench.proc.poll() is not None:
            raise AssertionError("the bench ended: " + "\n".join(bench.lines[-30:]))
        return _new_jobs(cluster, before)

    try:
        wait_for(queued, 180, "the bench's job in the queue", interval=0.2)
        work = bench.said(directory_marker)
        assert work and Path(work).is_dir(), bench.lines
        wait_for(
            lambda: queued() and any(Path(work).glob(written)),
            180,
            f"the job's processes to write {written} in {work}",
            interval=0.2,
        )
        assert bench.stop(120) == 128 + signal.SIGTERM, bench.lines[-30:]
        wait_for(lambda: not _new_jobs(cluster, before), 60, "the bench's jobs leave the queue")
        assert not Path(work).exists(), sorted(str(p) for p in Path(work).rglob("*"))[:5]
    finally:  # what is left here only if the test failed
        bench.kill()
        for info in _new_jobs(cluster, before):
            cluster.client.cancel(info.array_job_id or info.job_id)
        work = bench.said(directory_marker)
        if work and Path(work).parent == Path("/var/tmp"):
            shutil.rmtree(work, ignore_errors=True)


@pytest.mark.slurm
def test_a_stopped_startup_bench_cancels_its_job(slurm_cluster: SlurmCluster) -> None:
    argv = ["bench/startup.py", "--nodes", "2", "--repeat", "1", "--timeout", "300"]
    _stop_bench_with_a_job_running(slurm_cluster, argv, "# work directory ", "state/events/*/*")


@pytest.mark.slurm
def test_a_stopped_goodput_bench_cancels_its_job(slurm_cluster: SlurmCluster) -> None:
    argv = ["bench/goodput.py", "--quick", "--systems", "inplace", "--limit", "120"]
    _stop_bench_with_a_job_running(slurm_cluster, argv, "case directory ", "ledger*")
