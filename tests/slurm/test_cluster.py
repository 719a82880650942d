"""Real local Slurm cluster, driven through the project's own seam (SlurmClient).

These check the Slurm behaviour the rest of slurm_elastic builds on: per-node SLURM_*
variables, arrays, requeue with SLURM_RESTART_COUNT, signal delivery to the batch shell,
partition preemption with requeue, hostlist expansion, and the error mapping. Jobs write
into tmp_path: every node of the local cluster shares this filesystem.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurm_elastic.errors import SlurmControllerError
from slurm_elastic.slurm.commands import SlurmClient, SlurmJobNotFoundError
from slurm_elastic.slurm.hostlist import expand_hostlist
from slurm_elastic.slurm.jobstate import JobState
from tests.conftest import SlurmCluster
from tests.helpers import wait_for

pytestmark = pytest.mark.slurm

FINISHED = {s for s in JobState if s.is_terminal}


def script(body: str) -> str:
    return "#!/bin/bash\nset -u\n" + body.strip() + "\n"


def read_kv(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().split() if "=" in line)


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_two_node_job_runs_one_task_per_node(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    body = f"""
srun --output='{tmp_path}/task.%t' bash -c '
  for v in SLURM_NODEID SLURM_PROCID SLURM_JOB_NODELIST SLURMD_NODENAME; do
    echo "$v=${{!v}}"; done; echo HOSTNAME=$(hostname)'
"""
    job = slurm_cluster.client.submit(
        script(body), ["-N2", "--ntasks-per-node=1", "-o", "/dev/null"]
    )
    info = slurm_cluster.wait_state(job, FINISHED)
    assert info.state is JobState.COMPLETED, info
    tasks = [read_kv(tmp_path / f"task.{i}") for i in range(2)]
    assert [t["SLURM_PROCID"] for t in tasks] == ["0", "1"]
    assert sorted(t["SLURM_NODEID"] for t in tasks) == ["0", "1"]
    nodelist = {t["SLURM_JOB_NODELIST"] for t in tasks}
    assert len(nodelist) == 1
    names = [t["SLURMD_NODENAME"] for t in tasks]
    assert len(set(names)) == 2
    assert sorted(names) == sorted(slurm_cluster.client.hostnames(nodelist.pop()))
    if slurm_cluster.mode == "netns":  # each node has its own UTS namespace
        assert [t["HOSTNAME"] for t in tasks] == names


def test_array_runs_every_task_and_reports_state_per_task(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    body = f"""
echo "ARRAY=$SLURM_ARRAY_JOB_ID TASK=$SLURM_ARRAY_TASK_ID JOB=$SLURM_JOB_ID" \\
  > '{tmp_path}'/task.$SLURM_ARRAY_TASK_ID
[ "$SLURM_ARRAY_TASK_ID" != 3 ]   # task 3 fails on purpose
"""
    job = slurm_cluster.client.submit(script(body), ["--array=0-3", "-o", "/dev/null"])
    for task in range(4):
        slurm_cluster.wait_state(f"{job}_{task}", FINISHED)
    states = {i.ref: i.state for i in slurm_cluster.client.job_infos(job)}
    assert states == {
        f"{job}_0": JobState.COMPLETED,
        f"{job}_1": JobState.COMPLETED,
        f"{job}_2": JobState.COMPLETED,
        f"{job}_3": JobState.FAILED,
    }
    seen = [read_kv(tmp_path / f"task.{t}") for t in range(4)]
    assert [s["TASK"] for s in seen] == ["0", "1", "2", "3"]
    assert {s["ARRAY"] for s in seen} == {job}
    assert len({s["JOB"] for s in seen}) == 4
    # without slurmdbd the seam falls back from sacct to scontrol
    assert slurm_cluster.client.job_info(f"{job}_3").source in {"sacct", "scontrol"}


def test_requeue_restarts_only_that_task_with_restart_count(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    body = f"""
echo "${{SLURM_RESTART_COUNT:-unset}}" >> '{tmp_path}'/runs.$SLURM_ARRAY_TASK_ID
echo "${{SLURM_ELASTIC_SUBMISSION:-none}}" >> '{tmp_path}'/submission.$SLURM_ARRAY_TASK_ID
exec sleep 300
"""
    client = slurm_cluster.client
    # The submission id of `slurm-elastic submit`, in sbatch's environment: every task
    # gets it, and a requeued task again (agent/run_owner.py tells submissions apart).
    token = "0123456789abcdef"
    env = {"SLURM_ELASTIC_SUBMISSION": token}
    job = client.submit(script(body), ["--array=0-1", "-o", "/dev/null"], env=env)
    try:
        wait_for(
            lambda: lines(tmp_path / "runs.0") and lines(tmp_path / "runs.1"), 30, "both to start"
        )
        assert lines(tmp_path / "runs.1") == ["unset"]  # unset on the first run, not 0
        client.requeue(f"{job}_1")
        requeued = slurm_cluster.wait_job(
            f"{job}_1", lambda i: i.restarts == 1 and i.state is JobState.PENDING, 30, "requeued"
        )
        assert requeued.reason == "BeginTime"
        # Slurm holds a requeued job for cred_expire (10 s here). Do NOT shorten that with
        # 'scontrol update StartTime=now': if the task lands on the same node within
        # cred_expire it dies at once with "Job credential revoked" (state FAILED).
        wait_for(lambda: len(lines(tmp_path / "runs.1")) == 2, 40, "task 1 to restart")
        assert lines(tmp_path / "runs.1") == ["unset", "1"]
        assert client.job_info(f"{job}_1").state is JobState.RUNNING
        other = client.job_info(f"{job}_0")
        assert (other.state, other.restarts) == (JobState.RUNNING, 0)
        assert lines(tmp_path / "runs.0") == ["unset"]
        assert lines(tmp_path / "submission.0") == [token]
        assert lines(tmp_path / "submission.1") == [token, token]
    finally:
        client.cancel(job)


def test_usr2_from_scancel_batch_reaches_the_batch_script(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    body = f"""
trap 'echo USR2 > "{tmp_path}/signal"; exit 0' USR2
touch '{tmp_path}/ready'
while true; do sleep 0.1; done
"""
    client = slurm_cluster.client
    job = client.submit(script(body), ["-o", "/dev/null"])
    wait_for(lambda: (tmp_path / "ready").exists(), 30, "the batch script to start")
    client.cancel(job, signal="USR2", batch=True)
    wait_for(lambda: (tmp_path / "signal").exists(), 10, "the USR2 trap")
    assert slurm_cluster.wait_state(job, FINISHED).state is JobState.COMPLETED


@pytest.mark.slow
def test_high_partition_job_preempts_and_requeues_low_job(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    # The low job fills every node and ignores the notice, so Slurm itself must stop it
    # (USR2 at preemption, TERM after GraceTime=20 s) and requeue it (PreemptMode=REQUEUE).
    low_body = f"""
echo "${{SLURM_RESTART_COUNT:-unset}}" >> '{tmp_path}/low.runs'
trap 'echo usr2 >> "{tmp_path}/low.signals"' USR2
while true; do sleep 0.1; done
"""
    client = slurm_cluster.client
    n = str(len(slurm_cluster.nodes))
    low = client.submit(
        script(low_body),
        ["-p", "low", f"-N{n}", "--exclusive", "--signal=B:USR2@600", "--requeue",
         "-o", "/dev/null"],
    )  # fmt: skip
    try:
        wait_for(lambda: lines(tmp_path / "low.runs") == ["unset"], 30, "the low job to start")
        high = client.submit(
            script(f"echo ran > '{tmp_path}/high'"), ["-p", "high", "-N1", "-o", "/dev/null"]
        )
        wait_for(lambda: lines(tmp_path / "low.signals"), 15, "the preemption notice (USR2)")
        assert not (tmp_path / "high").exists()  # the grace time is still running
        high_info = slurm_cluster.wait_state(high, FINISHED, timeout=90)
        assert high_info.state is JobState.COMPLETED
        assert lines(tmp_path / "high") == ["ran"]
        slurm_cluster.wait_job(low, lambda i: (i.restarts or 0) >= 1, 30, "requeued")
        wait_for(lambda: lines(tmp_path / "low.runs") == ["unset", "1"], 60, "the low job rerun")
    finally:
        client.cancel(low)


def test_hostlist_expansion_agrees_with_scontrol(slurm_cluster: SlurmCluster) -> None:
    cases = [
        "n[1-3,5]",
        "n[001-010]",
        "r[1-2]n[3-4]",
        "node1,node[3-4],gpu[07-09]",
        "a[1-2]-b[8-10],c",
        "host",
        "x[9-11]y[01-02]",
        "n[1,3,5-6],m[0-1]",
    ]
    for hostlist in cases:
        assert list(expand_hostlist(hostlist)) == slurm_cluster.client.hostnames(hostlist), hostlist


def test_invalid_hostlist_is_an_error_not_an_empty_list(slurm_cluster: SlurmCluster) -> None:
    from slurm_elastic.errors import SlurmCommandError

    # scontrol prints "Invalid hostlist" on stderr but exits 0 (Slurm 22.05)
    with pytest.raises(SlurmCommandError, match="rejects the hostlist 'n\\[3-1\\]'"):
        slurm_cluster.client.hostnames("n[3-1]")


def test_unknown_job_raises_job_not_found(slurm_cluster: SlurmCluster) -> None:
    with pytest.raises(SlurmJobNotFoundError, match="Invalid job id"):
        slurm_cluster.client.job_info("999999")


def test_sbatch_rejection_carries_slurms_reason(slurm_cluster: SlurmCluster) -> None:
    from slurm_elastic.errors import SlurmCommandError

    with pytest.raises(SlurmCommandError, match="invalid partition") as err:
        slurm_cluster.client.submit(script("true"), ["-p", "no_such_partition"])
    assert err.value.returncode != 0
    assert err.value.argv[0] == "sbatch"


@pytest.mark.slow
def test_unreachable_controller_raises_controller_error(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    # A copy of the real config pointing at a port where no slurmctld listens:
    # Slurm's clients retry for ~9 s, then say "Unable to contact slurm controller".
    conf = Path(slurm_cluster.env["SLURM_CONF"]).read_text().splitlines()
    bad = tmp_path / "slurm.conf"
    bad.write_text(
        "\n".join("SlurmctldPort=1" if c.startswith("SlurmctldPort=") else c for c in conf) + "\n"
    )
    client = SlurmClient(env={**os.environ, "SLURM_CONF": str(bad)}, timeout_s=60)
    with pytest.raises(SlurmControllerError, match="could not reach the Slurm controller"):
        client.submit(script("true"))
    assert client.ping() is False
