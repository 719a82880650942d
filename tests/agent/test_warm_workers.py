"""Warm worker starts (slurm_elastic.agent.warm_workers): a worker started through a
waiting interpreter sees what a cold one sees, through torch's own process context.

Real processes, torch's real ``start_processes`` and ``SubprocessHandler``; the seam is
pinned below so that a torch release that moves it fails here (scripts/test.sh runs
tests/agent on each supported torch).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes
from torch.distributed.elastic.multiprocessing import api as mp_api
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from slurm_elastic.agent.warm_handler import warm_starts
from slurm_elastic.agent.warm_workers import (
    WarmStart,
    WarmWorkers,
    import_time_differences,
    parse_command,
)
from tests.helpers import wait_for

# What a worker reports about itself: everything a cold start fixes and a warm one must
# reproduce (the pid and whether torch was already imported aside).
PROBE = textwrap.dedent(
    """
    import json, os, signal, sys
    preloaded = "torch" in sys.modules
    import torch
    print(json.dumps({
        "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
        "main_file": sys.modules["__main__"].__file__,
        "env": {k: os.environ.get(k) for k in ("RANK", "TORCHELASTIC_PROBE", "OMP_NUM_THREADS")},
        "session_leader": os.getsid(0) == os.getpid(), "umask": os.umask(0o22),
        "threads": torch.get_num_threads(), "preloaded": preloaded, "pid": os.getpid(),
        "usr2": str(signal.getsignal(signal.SIGUSR2)),
    }), flush=True)
    print("to stderr", file=sys.stderr)
    if sys.argv[1:2] == ["hang"]:
        import time
        while True:
            time.sleep(0.1)
    if sys.argv[1:2] == ["fail"]:
        raise SystemExit(7)
    """
)


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    env.pop("RANK", None)
    return env


def _warm(nproc: int, *args: str, **env: str) -> WarmWorkers:
    """Interpreters for workers that run ``<this python> *args``."""
    return WarmWorkers(nproc, _env(**env), (sys.executable, *args))


def _start(
    tmp: Path, name: str, args: tuple, warm: WarmWorkers | None, nproc: int = 2
) -> mp_api.PContext:
    (tmp / name).mkdir()
    with warm_starts(warm):
        return start_processes(
            name=name,
            entrypoint=sys.executable,
            args={r: args for r in range(nproc)},
            envs={r: {"RANK": str(r), "TORCHELASTIC_PROBE": f"v{r}"} for r in range(nproc)},
            logs_specs=DefaultLogsSpecs(log_dir=str(tmp / name), redirects=Std.ALL, tee=Std.NONE),
        )


def _reports(pc: mp_api.PContext, exitcode: int = 0) -> dict[int, dict[str, Any]]:
    result = wait_for(lambda: pc.wait(0.5), 120, "the workers to exit")
    out = {r: json.loads(Path(pc.stdouts[r]).read_text()) for r in pc.stdouts}  # type: ignore[attr-defined]
    for r in out:
        assert "to stderr" in Path(pc.stderrs[r]).read_text()  # type: ignore[attr-defined]
        assert (result.failures[r].exitcode if r in result.failures else 0) == exitcode
    return out


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("RANK", raising=False)
    script = tmp_path / "scripts" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    return script


def test_a_warm_worker_sees_what_a_cold_one_sees(tmp_path: Path, probe: Path) -> None:
    cold = _reports(_start(tmp_path, "cold", ("-u", str(probe), "a b", "c"), None))
    warm = _warm(2, "-u", str(probe), "a b", "c")
    pids = warm.pids()
    try:
        pc = _start(tmp_path, "warm", ("-u", str(probe), "a b", "c"), warm)
        assert sorted(pc.pids().values()) == sorted(pids)  # the waiting interpreters
        hot = _reports(pc)
    finally:
        warm.close()
    for rank in (0, 1):
        assert hot[rank].pop("preloaded") and not cold[rank].pop("preloaded")
        hot[rank].pop("pid"), cold[rank].pop("pid")
        assert hot[rank] == cold[rank]
    assert cold[1]["argv"] == [str(probe), "a b", "c"]
    assert cold[1]["env"] == {"RANK": "1", "TORCHELASTIC_PROBE": "v1", "OMP_NUM_THREADS": "1"}
    assert cold[1]["path0"] == str(probe.parent) and cold[1]["session_leader"]


def test_a_module_entrypoint_runs_warm_as_python_m_would(
    tmp_path: Path, probe: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(probe.parent)  # python -m finds modules in the working directory
    cold = _reports(_start(tmp_path, "cold", ("-u", "-m", "probe", "x"), None))
    warm = _warm(2, "-u", "-m", "probe", "x")
    try:
        hot = _reports(_start(tmp_path, "warm", ("-u", "-m", "probe", "x"), warm))
    finally:
        warm.close()
    for rank in (0, 1):
        assert hot[rank].pop("preloaded")
        for report in (hot[rank], cold[rank]):
            report.pop("preloaded", None), report.pop("pid")
        assert hot[rank] == cold[rank]
    assert cold[0]["argv"][0] == str(probe) and cold[0]["name"] == "__main__"


def test_torch_sees_a_warm_workers_exit_status_and_stops_it_like_a_cold_one(
    tmp_path: Path, probe: Path
) -> None:
    warm, second = _warm(1, "-u", str(probe), "fail"), _warm(1, "-u", str(probe), "hang")
    try:
        failed = _reports(_start(tmp_path, "fail", ("-u", str(probe), "fail"), warm, 1), 7)
        assert failed[0]["preloaded"]
        (second_pid,) = second.pids()
        pc = _start(tmp_path, "warm", ("-u", str(probe), "hang"), second, nproc=1)
        assert pc.pids()[0] == second_pid
        wait_for(lambda: Path(pc.stdouts[0]).read_text(), 120, "the worker's report")  # type: ignore[attr-defined]
        (pid,) = pc.pids().values()
        pc.close(signal.SIGTERM)  # torch's killpg of the worker's session
        wait_for(lambda: _gone(pid), 30, "the worker to end")
    finally:
        warm.close()
        second.close()


def _ignores(pid: int, sig: signal.Signals) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (sig - 1)))
    return False


def test_a_notice_to_every_process_does_not_end_a_waiting_interpreter(
    tmp_path: Path, probe: Path
) -> None:
    """``scancel --signal=USR2`` without ``--batch`` reaches every process of the step: the
    waiting interpreter ignores it (the agent acts on it); its worker has the default."""
    warm = _warm(1, "-u", str(probe))
    (pid,) = warm.pids()
    try:
        wait_for(lambda: _ignores(pid, signal.SIGUSR2), 60, "the interpreter to ignore USR2")
        os.kill(pid, signal.SIGUSR2)
        os.kill(pid, signal.SIGUSR1)
        pc = _start(tmp_path, "warm", ("-u", str(probe)), warm, nproc=1)
        assert pc.pids()[0] == pid
        report = _reports(pc)[0]
        assert report["preloaded"] and report["usr2"] == str(signal.SIG_DFL)
    finally:
        warm.close()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_changed_import_time_variable_starts_the_worker_cold(
    tmp_path: Path, probe: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="slurm_elastic.agent.warm_workers")
    warm = _warm(2, "-u", str(probe), "a", PYTHONHASHSEED="1")  # the agent's env has none
    pids = warm.pids()
    pc = _start(tmp_path, "changed", ("-u", str(probe), "a"), warm)
    reports = _reports(pc)
    assert not any(r["preloaded"] for r in reports.values())
    assert not set(pc.pids().values()) & set(pids)
    assert "PYTHONHASHSEED differ from the interpreter's start" in caplog.text
    for pid in pids:  # the unusable interpreters are not left behind
        assert _gone(pid)


def test_a_waiting_interpreter_shows_the_workers_command_and_serves_only_it(
    tmp_path: Path, probe: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="slurm_elastic.agent.warm_workers")
    warm = _warm(1, "-u", str(probe), "planned")
    (pid,) = warm.pids()
    try:
        # read once the child has exec'd (before that its cmdline can be empty)
        raw = wait_for(lambda: Path(f"/proc/{pid}/cmdline").read_bytes() or None, 30, "cmdline")
        cmdline = raw.split(b"\0")
        assert [c.decode() for c in cmdline[-3:-1]] == [str(probe), "planned"]  # ps, pgrep -f
        pc = _start(tmp_path, "other", ("-u", str(probe), "other"), warm, nproc=1)
        assert pc.pids()[0] != pid and not _reports(pc)[0]["preloaded"]
        assert "the command differs from the one the interpreter was started for" in caplog.text
        assert _gone(pid)
    finally:
        warm.close()
    with pytest.raises(ValueError, match="not a command a warm interpreter can run"):
        WarmWorkers(1, _env(), ("numactl", sys.executable, "-u", "t.py"))


def test_a_command_other_than_python_u_starts_cold() -> None:
    assert parse_command((sys.executable, "-u", "t.py", "--x")) == (["t.py", "--x"], False)
    assert parse_command((sys.executable, "-u", "-m", "pkg.mod")) == (["pkg.mod"], True)
    assert parse_command(("numactl", "--cpunodebind=0", sys.executable, "-u", "t.py")) is None
    assert parse_command((sys.executable, "t.py")) is None
    assert parse_command((sys.executable, "-u", "-m")) is None
    assert parse_command(("/other/python", "-u", "t.py")) is None


def test_only_variables_read_after_start_up_may_differ() -> None:
    started = {"PATH": "/bin", "OMP_NUM_THREADS": "2", "SLURM_ELASTIC_ROUND": "0"}
    wanted = {
        **started,
        "RANK": "3",
        "MASTER_PORT": "1234",
        "TORCHELASTIC_RUN_ID": "r",
        "SLURM_ELASTIC_ROUND": "4",
    }
    assert import_time_differences(started, wanted) == []
    wanted.update(OMP_NUM_THREADS="1", LD_PRELOAD="x.so")
    del wanted["PATH"]
    assert import_time_differences(started, wanted) == ["LD_PRELOAD", "OMP_NUM_THREADS", "PATH"]


def test_the_start_message_is_json_and_checked() -> None:
    start = WarmStart(argv=["t.py"], module=False, env={"A": "1"}, cwd="/", umask=0o22)
    assert WarmStart.decode(start.encode()) == start
    bad = json.loads(start.encode())
    bad["env"] = {"A": 1}
    with pytest.raises(ValueError, match="malformed"):
        WarmStart.decode(json.dumps(bad).encode())


def test_unused_interpreters_exit_when_the_agent_closes_them_or_dies(tmp_path: Path) -> None:
    warm = _warm(1, "-u", "t.py")
    (pid,) = warm.pids()
    warm.close()
    assert _gone(pid)
    # An agent killed outright: its end of the socket closes, the interpreter reads
    # end-of-file once torch is imported, and exits.
    code = (
        "import os, sys; from slurm_elastic.agent.warm_workers import WarmWorkers\n"
        "w = WarmWorkers(1, dict(os.environ), (sys.executable, '-u', 't.py'))\n"
        "print(w.pids()[0], flush=True); os._exit(9)"
    )
    agent = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    orphan = int(agent.stdout.split()[0])
    wait_for(lambda: _gone(orphan), 120, "the orphaned interpreter to exit")


def test_the_seam_in_torch_is_where_we_replace_it() -> None:
    """torch builds each worker's handler through ``api.get_subprocess_handler`` and the
    handler calls ``self._popen(args, env)`` once its log files and local rank are set."""
    assert callable(mp_api.get_subprocess_handler)
    assert list(inspect.signature(mp_api.get_subprocess_handler).parameters) == [
        "entrypoint",
        "args",
        "env",
        "stdout",
        "stderr",
        "local_rank_id",
        "numa_options",
    ]
    assert list(inspect.signature(SubprocessHandler._popen).parameters) == ["self", "args", "env"]
    seen: dict[str, Any] = {}

    class Recording(SubprocessHandler):
        def _popen(self, args: tuple, env: dict[str, str]) -> subprocess.Popen:
            seen.update(
                args=args, rank=self.local_rank_id, out=self._stdout, err=self._stderr, env=env
            )
            return super()._popen(args, env)

    handler = Recording(
        entrypoint=sys.executable,
        args=("-c", "pass"),
        env={"X_PROBE": "1"},
        stdout=os.devnull,
        stderr=None,
        local_rank_id=3,
        numa_options=None,
    )
    handler.proc.wait(30)
    assert seen["args"] == (sys.executable, "-c", "pass") and seen["rank"] == 3
    assert seen["out"] is not None and seen["err"] is None and seen["env"]["X_PROBE"] == "1"
    assert seen["env"]["PATH"] == os.environ["PATH"]  # the agent's environment, inherited
