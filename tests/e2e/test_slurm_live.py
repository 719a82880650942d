"""In place on the real local Slurm: an ``elastic_array`` whose task is preempted by a
``high``-partition job leaves in place (the other task's worker keeps its process and
loses no step), and the requeued task joins the running world in place again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from slurm_elastic.slurm.jobstate import JobState
from tests.conftest import SlurmCluster
from tests.e2e.jobs import (
    assert_each_sample_once_per_full_epoch,
    effective_ledger,
    job_values,
    max_abs_diff,
    render,
    rounds,
)
from tests.e2e.test_slurm_e2e import ATOL, DATASET, TERMINAL, logs, reference_params
from tests.helpers import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.netns, pytest.mark.timeout(900)]


def ledger(tmp: Path) -> list[dict]:
    path = tmp / "ledger.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def world_now(tmp: Path) -> int:  # the world of the newest ledger record
    records = ledger(tmp)
    return records[-1]["world"] if records else 0


def test_array_task_preempted_by_high_job_leaves_and_rejoins_in_place(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    client = slurm_cluster.client
    train_args = [
        "--steps", "2500", "--dataset-size", str(DATASET), "--global-batch", "16",
        "--save-every", "50", "--step-time", "0.1",
        "--out", str(tmp_path / "params.pt"), "--ledger", str(tmp_path / "ledger.jsonl"),
    ]  # fmt: skip
    values = job_values(
        tmp_path, "elastic_array", train_args, nnodes="1:2", nproc_per_node=1,
        cpus_per_task=2, partition="low",
    )  # fmt: skip
    job = client.submit(render("elastic_array", values))
    state = tmp_path / "state"
    try:
        # two tasks (the local cluster is shared: a third node is often busy)
        wait_for(lambda: world_now(tmp_path) == 2, 300, f"a world of 2\n{logs(tmp_path)}")
        wait_for(lambda: len(ledger(tmp_path)) > 60, 60, "training at 2")
        victim = client.job_info(f"{job}_1").node_list
        t0 = time.time()
        before = {r["pid"] for r in ledger(tmp_path) if r["time"] < t0 and r["world"] == 2}
        client.submit(
            f"#!/bin/bash\n#SBATCH -p high -w {victim} --exclusive\n"
            f"#SBATCH -o {tmp_path}/logs/high.out\nsleep 5\n"
        )
        shrunk = wait_for(
            lambda: [e for e in rounds(state, job, t0) if e["group_world_size"] == 1],
            120,
            f"the survivor to re-form alone\n{logs(tmp_path)}",
        )
        t1 = shrunk[0]["time"]
        wait_for(
            lambda: any(r["world"] == 2 and r["time"] > t1 for r in ledger(tmp_path)),
            400,
            f"the requeued task to rejoin\n{logs(tmp_path)}",
        )
        infos = wait_for(
            lambda: (i := client.job_infos(job)) and all(x.state in TERMINAL for x in i) and i,
            500,
            f"the run to finish\n{logs(tmp_path)}",
        )
        assert {i.state for i in infos} == {JobState.COMPLETED}, infos
    finally:
        client.cancel(job)

    records = ledger(tmp_path)
    alone = {r["pid"] for r in records if r["world"] == 1 and r["time"] > t0}
    last = {r["pid"] for r in records if r["step"] == max(x["step"] for x in records)}
    # task 0's worker trained through both changes in the same process
    assert len(alone) == 1 and alone <= before and alone <= last, (before, alone, last)
    assert len(last) == 2  # ...and finished in a world of 2 with the requeued task
    rounds_per_step: dict[int, set[int]] = {}
    for r in records:
        rounds_per_step.setdefault(r["step"], set()).add(r["round"])
    assert all(len(v) == 1 for v in rounds_per_step.values()), "a step was redone"
    ledger_by_epoch = effective_ledger(tmp_path / "ledger.jsonl")
    assert_each_sample_once_per_full_epoch(ledger_by_epoch, DATASET)
    assert max_abs_diff(tmp_path / "params.pt", reference_params(tmp_path, train_args)) < ATOL
