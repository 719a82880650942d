"""End to end on the local Slurm cluster: the real templates, agents, rendezvous,
checkpoints and examples/train_ddp.py, preempted and requeued by Slurm itself.

The final parameters are compared with an uninterrupted single-process run of the same
training (fixed global batch): equal within ``ATOL`` (float reassociation across world
sizes only; see docs/checkpoint.md), and every sample is used exactly once per epoch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_elastic.slurm.jobstate import JobState
from tests.conftest import SlurmCluster
from tests.e2e.jobs import (
    TRAIN,
    agent_events,
    assert_ledger_ok,
    job_values,
    max_abs_diff,
    render,
    rounds,
)
from tests.helpers import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

ATOL = 2e-6  # as tests/checkpoint/test_exactness.py; measured 1.8e-7 at 300 steps
DATASET = 400
TERMINAL = {s for s in JobState if s.is_terminal}


def reference_params(tmp: Path, train_args: list[str], script: Path = TRAIN) -> Path:
    """The same training, uninterrupted, one process (no Slurm)."""
    ref = tmp / "reference"
    ref.mkdir()
    out = ref / "params.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "slurm_elastic.cli.main",
            "-q",
            "agent",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "1",
            "--rdzv-id",
            "reference",
            "--state-dir",
            str(ref / "state"),
            str(script),
            *train_args,
            "--step-time",
            "0",
            "--out",
            str(out),
            "--ledger",
            str(ref / "ledger.jsonl"),
        ],
        env={**env, "OMP_NUM_THREADS": "1"},
        check=True,
        timeout=300,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return out


def latest_world(state: Path, run_id: str, since: float) -> int | None:
    events = rounds(state, run_id, since)
    return events[-1]["group_world_size"] if events else None


def training_at(state: Path, run_id: str, nodes: int, since: float) -> bool:
    """Workers of a world of ``nodes`` nodes (1 worker each) have started training."""
    return any(
        e["kind"] == "train.start" and e["world_size"] == nodes and e["time"] >= since
        for e in agent_events(state, run_id)
    )


def logs(tmp: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
        for p in sorted((tmp / "logs").glob("*.out"))
    )


def test_elastic_array_survives_requeue_usr2_and_partition_preemption(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    client = slurm_cluster.client
    train_args = [
        "--steps",
        "900",
        "--dataset-size",
        str(DATASET),
        "--global-batch",
        "16",
        "--save-every",
        "25",
        # paced (released after the last regrow): 900 steps x 0.2 s is the time the three
        # requeue cycles may take (0.1 s ran out once in a loaded suite: the run ended at
        # step 900 while the third requeued task was joining)
        "--step-time",
        "0.2",
        "--out",
        str(tmp_path / "params.pt"),
        "--ledger",
        str(tmp_path / "ledger.jsonl"),
        "--pace-until-file",  # paced until the last regrow, below
        str(tmp_path / "release"),
    ]
    values = job_values(
        tmp_path,
        "elastic_array",
        train_args,
        nnodes="1:4",
        nproc_per_node=1,
        cpus_per_task=2,
        partition="low",
        sbatch_args=["--hold"],
    )
    job = client.submit(render("elastic_array", values))
    state = tmp_path / "state"
    try:
        # Training starts as soon as the first task runs (min_nodes=1)...
        client.release(f"{job}_0")
        wait_for(
            lambda: training_at(state, job, 1, 0), 120, f"task 0 to train alone\n{logs(tmp_path)}"
        )
        # ...and the other tasks join it when Slurm starts them.
        client.release(job)
        wait_for(
            lambda: training_at(state, job, 4, 0),
            180,
            f"training with all 4 nodes in one world\n{logs(tmp_path)}",
        )

        def preempt_and_regrow(action: str, act) -> None:  # type: ignore[no-untyped-def]
            t0 = time.time()
            act()
            wait_for(
                lambda: latest_world(state, job, t0) == 3,
                90,
                f"survivors at 3 nodes after {action}\n{logs(tmp_path)}",
            )
            shrunk = rounds(state, job, t0)[0]["time"] - t0
            assert shrunk < 45, f"survivors needed {shrunk:.1f} s to go on after {action}"
            wait_for(
                lambda: latest_world(state, job, t0 + shrunk) == 4,
                180,
                f"the requeued task to rejoin after {action}\n{logs(tmp_path)}",
            )
            wait_for(lambda: training_at(state, job, 4, t0 + shrunk), 60, "training at 4 again")

        preempt_and_regrow("scontrol requeue", lambda: client.requeue(f"{job}_1"))
        preempt_and_regrow(
            "scancel --signal=USR2", lambda: client.cancel(f"{job}_2", signal="USR2", batch=True)
        )
        victim = client.job_info(f"{job}_3").node_list
        preempt_and_regrow(
            "a high-partition job",
            lambda: client.submit(
                f"#!/bin/bash\n#SBATCH -p high -w {victim} --exclusive\n"
                f"#SBATCH -o {tmp_path}/logs/high.out\nsleep 5\n"
            ),
        )
        (tmp_path / "release").touch()  # every change is done: the rest at full speed

        infos = wait_for(
            lambda: (i := client.job_infos(job)) and all(x.state in TERMINAL for x in i) and i,
            400,
            f"the run to finish\n{logs(tmp_path)}",
        )
        assert {i.state for i in infos} == {JobState.COMPLETED}, infos
        assert not [q for q in client.queue() if q.array_job_id == job or q.job_id == job]
    finally:
        client.cancel(job)

    assert_ledger_ok(tmp_path / "ledger.jsonl", DATASET)
    assert max_abs_diff(tmp_path / "params.pt", reference_params(tmp_path, train_args)) < ATOL


def worker_pids(tmp: Path) -> list[int]:
    """PIDs of train_ddp.py workers of this test (all nodes share the PID namespace)."""
    out = subprocess.run(["pgrep", "-f", f"{TRAIN}.*{tmp}"], capture_output=True, text=True)
    pids = [int(p) for p in out.stdout.split()]
    # the agents' command lines name the script too; workers are the agents' children
    agents = set(
        int(p)
        for p in subprocess.run(
            ["pgrep", "-f", f"slurm_elastic.cli.main agent.*{TRAIN}"],
            capture_output=True,
            text=True,
        ).stdout.split()
    )
    return [p for p in pids if p not in agents]


def test_fault_tolerant_job_restarts_the_group_from_the_checkpoint_after_a_worker_is_killed(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    client = slurm_cluster.client
    train_args = [
        "--steps",
        "300",
        "--dataset-size",
        str(DATASET),
        "--global-batch",
        "16",
        "--save-every",
        "20",
        "--step-time",
        "0.1",
        "--out",
        str(tmp_path / "params.pt"),
        "--ledger",
        str(tmp_path / "ledger.jsonl"),
        "--pace-until-file",  # paced until the group restarted, below
        str(tmp_path / "release"),
    ]
    values = job_values(
        tmp_path,
        "fault_tolerant",
        train_args,
        nodes=4,
        nproc_per_node=2,
        max_restarts=3,
        partition="low",
        exclusive=True,
    )
    job = client.submit(render("fault_tolerant", values))
    state = tmp_path / "state"
    try:
        wait_for(
            lambda: training_at(state, job, 8, 0),
            180,
            f"8 workers training on 4 nodes\n{logs(tmp_path)}",
        )
        wait_for(
            lambda: (tmp_path / "state" / "checkpoints" / job / "step_20").exists(),
            120,
            "the first checkpoint",
        )
        t0 = time.time()
        victim = worker_pids(tmp_path)[-1]
        os.kill(victim, 9)
        restarted = wait_for(
            lambda: [
                e
                for e in agent_events(state, job)
                if e["kind"] == "train.start" and e["time"] > t0 and e["world_size"] == 8
            ],
            120,
            f"the group to restart at 8 workers\n{logs(tmp_path)}",
        )
        assert min(e["step"] for e in restarted) >= 20  # resumed from a checkpoint, not step 0
        (tmp_path / "release").touch()  # the rest at full speed
        info = slurm_cluster.wait_state(job, TERMINAL, timeout=400)
        assert info.state == JobState.COMPLETED, f"{info}\n{logs(tmp_path)}"
        kinds = [e["kind"] for e in agent_events(state, job)]
        assert kinds.count("agent.exit") == 4 and "agent.restart" in kinds
    finally:
        client.cancel(job)

    assert_ledger_ok(tmp_path / "ledger.jsonl", DATASET)
    assert max_abs_diff(tmp_path / "params.pt", reference_params(tmp_path, train_args)) < ATOL
