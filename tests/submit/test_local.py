"""cluster="local": real node agents (slurm_elastic.agent.run_agent) as processes, real gloo.

Also the process-tree reaping that ``cancel()`` relies on, on plain processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slurm_elastic.submit import JobState, LocalJob, processes, submit
from tests.helpers import wait_for

ENV = {"OMP_NUM_THREADS": "1"}

TRAIN = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{dist.get_rank()}"), "w") as fh:
        fh.write(f"{dist.get_world_size()} {t.item():.0f} {os.environ['SLURM_ELASTIC_RUN_ID']}")
    dist.destroy_process_group()
    """
)

# A worker that will not stop: ignores SIGTERM and the preempt signal.
STUBBORN = textwrap.dedent(
    """
    import os, signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    open(os.path.join(os.environ["OUT_DIR"], f"started-{os.getpid()}"), "w").close()
    while True:
        time.sleep(0.1)
    """
)


def _script(tmp_path: Path, text: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(text)
    return str(path)


def _all_pids(job: LocalJob) -> set[processes.ProcessKey]:
    keys = processes.descendants(job.pids)
    for pid in job.pids:
        stat = Path(f"/proc/{pid}/stat").read_text()
        keys.add((pid, int(stat[stat.rfind(")") + 2 :].split()[19])))
    return keys


def test_local_job_runs_two_node_agents_that_train_together(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    job = submit(
        _script(tmp_path, TRAIN),
        cluster="local",
        folder=tmp_path / "job",
        nnodes="2:2",
        last_call_timeout_s=1,
        join_timeout_s=120,
        env={**ENV, "OUT_DIR": str(out)},
    )
    with job:
        assert job.wait(timeout_s=240, poll_s=0.2) == JobState.COMPLETED
    assert job.exit_codes() == [0, 0]
    results = sorted(p.read_text() for p in out.iterdir())
    assert [r.split()[:2] for r in results] == [["2", "3"], ["2", "3"]]
    assert {r.split()[2] for r in results} == {job.run_id}
    assert all(p.exists() for p in job.log_paths())
    assert (tmp_path / "job" / "rdzv").is_dir(), "the agents shared the job's rendezvous dir"


@pytest.mark.parametrize(
    ("shutdown_timeout_s", "grace_s"),
    [
        (1.0, 30.0),  # the agents stop their stubborn workers themselves (SIGKILL after 1 s)
        (60.0, 1.0),  # we SIGKILL the agents first: their orphaned workers must go too
    ],
)
def test_cancel_leaves_no_agent_or_worker_alive(
    tmp_path: Path, shutdown_timeout_s: float, grace_s: float
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    job = submit(
        _script(tmp_path, STUBBORN),
        cluster="local",
        folder=tmp_path / "job",
        nnodes="2:2",
        nproc_per_node=2,
        last_call_timeout_s=1,
        shutdown_timeout_s=shutdown_timeout_s,
        env={**ENV, "OUT_DIR": str(out)},
    )
    try:
        wait_for(lambda: len(list(out.iterdir())) == 4, 120, "4 workers to start")
        before = _all_pids(job)
        assert len(before) >= 6, f"expected 2 agents + 4 workers, saw {before}"
        assert job.state() == JobState.RUNNING
        job.cancel(grace_s=grace_s)
    finally:
        job.cancel(grace_s=0)
    assert job.state() == JobState.CANCELLED
    survivors = [k for k in before if processes.alive(k)]
    assert survivors == []
    workers = {int(p.name.split("-")[1]) for p in out.iterdir()}
    assert not any(processes.alive((pid, k[1])) for pid in workers for k in before if k[0] == pid)


def test_stop_tree_kills_a_term_ignoring_tree_in_other_sessions(tmp_path: Path) -> None:
    # parent ignores TERM and starts a child in its own session (as torch does for
    # workers) that ignores TERM too; the child writes its pid.
    child_code = (
        "import signal, time, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "open(sys.argv[1], 'w').write('x'); time.sleep(600)"
    )
    parent_code = textwrap.dedent(
        f"""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        subprocess.Popen([sys.executable, "-c", {child_code!r}, sys.argv[1]],
                         start_new_session=True)
        time.sleep(600)
        """
    )
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", parent_code, str(ready)])
    wait_for(ready.exists, 30, "the grandchild to start")
    tree = processes.descendants([proc.pid])
    assert len(tree) == 1
    left = processes.stop_tree([proc], grace_s=0.5)
    assert left == set()
    assert proc.returncode == -signal.SIGKILL
    assert not any(processes.alive(k) for k in tree)


def test_stop_tree_is_quick_for_cooperative_processes() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    wait_for(lambda: processes.alive((proc.pid, _start(proc.pid))), 10, "the process to exist")
    processes.stop_tree([proc], grace_s=30)
    assert proc.returncode == -signal.SIGTERM


def _start(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rfind(")") + 2 :].split()[19])


def test_local_nodes_do_not_inherit_slurm_variables() -> None:
    from slurm_elastic.submit.local import node_environment

    env = node_environment(
        {"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1", "SLURM_ELASTIC_MAX_NODES": "2", "A": "1"},
        {"B": "2"},
    )
    assert env == {"SLURM_ELASTIC_MAX_NODES": "2", "A": "1", "B": "2", "PYTHONUNBUFFERED": "1"}
    assert os.environ.get("PYTHONUNBUFFERED", "") in ("", "1", "0")  # we did not touch ours
