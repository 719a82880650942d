"""In place on the real local Slurm: a 4-task ``elastic_array`` (3 members + 1 hot spare).

The first test trains ``examples/train_own_loop.py``: the user's own loop with its own
``DataLoader``, a ``GradScaler``, two optimizers and an EMA. One job goes through, in order:

1. **graceful leave + spare promotion**: a member's node is taken by a ``high``-partition
   job (Slurm preempts the task: USR2, requeue); the spare is promoted in place; the
   other members keep their worker processes and no step is redone;
2. **hard loss**: a second member's agent and worker are SIGKILLed (the node is gone for
   the job); the survivors roll back to their last commit (at most the failed step is
   redone) and re-form in place, keeping their processes;
3. **join in place**: the preempted task, requeued by Slurm, joins the running world.

At the end: the steady survivor's worker trained through all three changes in the same
process, the ledger has every sample exactly once per epoch, and the final parameters
match an uninterrupted run within the e2e tolerance. The fallback to the restart path
is the second test (a 2-task array whose workers give a new round too little time).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.slurm.jobstate import JobState
from tests.conftest import SlurmCluster
from tests.e2e.jobs import (
    REPO,
    assert_close_params,
    assert_ledger_ok,
    job_values,
    max_abs_diff,
    render,
)
from tests.e2e.test_slurm_e2e import ATOL, DATASET, TERMINAL, logs, reference_params
from tests.helpers import read_jsonl, wait_for

OWN_LOOP = REPO / "examples" / "train_own_loop.py"

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.netns, pytest.mark.timeout(900)]


def ledger(tmp: Path) -> list[dict[str, Any]]:
    return read_jsonl(tmp / "ledger.jsonl")


def task_of(pid: int) -> tuple[str, str]:
    """(array task id, node) of a worker process (netns nodes share the PID space)."""
    env = dict(
        item.split("=", 1)
        for item in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
        if "=" in item
    )
    return env["SLURM_ARRAY_TASK_ID"], env["SLURMD_NODENAME"]


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def idle_nodes(client: Any) -> list[str]:
    out = client.run(["sinfo", "--noheader", "--partition=low", "--Node", "--format=%N %t"])
    return [line.split()[0] for line in out.stdout.splitlines() if line.split()[1:] == ["idle"]]


def wait_idle_nodes(client: Any, count: int) -> None:
    """Wait (up to 10 min) for ``count`` idle nodes: the cluster may be shared."""
    wait_for(
        lambda: len(idle_nodes(client)) >= count,
        600,
        f"{count} idle nodes (busy at the start: {client.run(['squeue', '--noheader']).stdout})",
        interval=2,
    )


def current_members(tmp: Path, world: int, since: float) -> dict[int, int] | None:
    """``{pid: rank}`` of the newest step run by ``world`` ranks after ``since``."""
    by_step: dict[int, dict[int, int]] = {}
    for r in ledger(tmp):
        if r["time"] > since and r["world"] == world:
            by_step.setdefault(r["step"], {})[r["pid"]] = r["rank"]
    full = [m for _, m in sorted(by_step.items()) if len(m) == world]
    return full[-1] if full else None


def test_four_task_array_leaves_promotes_loses_and_rejoins_in_place(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    if len(slurm_cluster.nodes) < 4:
        pytest.skip(reason=f"needs 4 Slurm nodes, the cluster has {slurm_cluster.nodes}")
    client = slurm_cluster.client
    # The cluster may be shared: with a node busy the fourth task starts late (or after
    # the run ended) and the members/spare layout below never forms. Start on 4 idle nodes.
    wait_idle_nodes(client, 4)
    # The users' own loop (issue #20): its own DataLoader (2 loader workers), a GradScaler,
    # two optimizers and an EMA registered with ElasticSession; ElasticLoop (train_ddp.py)
    # goes through in-place changes on this Slurm in test_slurm_e2e.py and the fault matrix.
    train_args = [
        "--steps", "1200", "--dataset-size", str(DATASET), "--global-batch", "12",
        # paced until the rejoin: 1200 x 0.2 s is the time every change may take
        "--save-every", "50", "--step-time", "0.2", "--num-workers", "2",
        "--out", str(tmp_path / "params.pt"), "--ledger", str(tmp_path / "ledger.jsonl"),
        "--pace-until-file", str(tmp_path / "release"),  # paced until the rejoin, below
    ]  # fmt: skip
    values = job_values(
        tmp_path, "elastic_array", train_args, nnodes="1:3", nproc_per_node=1,
        cpus_per_task=2, partition="low", script=OWN_LOOP,
    )  # fmt: skip
    script = render("elastic_array", values)
    assert "#SBATCH --array=0-2\n" in script
    # max_nodes + 1 hot spare, as README says: a command-line --array overrides the file's
    job = client.submit(script, ["--array=0-3"])
    try:
        # 0. three members train; the fourth task runs as a spare (an agent, no worker)
        wait_for(
            lambda: (
                current_members(tmp_path, 3, 0)
                and sum(i.state == JobState.RUNNING for i in client.job_infos(job)) == 4
            ),
            400,
            f"3 members training and a spare running\n{logs(tmp_path)}",
        )
        start = current_members(tmp_path, 3, 0) or {}
        tasks = {pid: task_of(pid) for pid in start}
        by_rank = sorted(start, key=lambda p: start[p])
        # rank 0's node hosts the round's store; keep it (store loss is bench/recovery.py's)
        keep, leaver, victim = by_rank[0], by_rank[1], by_rank[2]

        # 1. graceful leave of `leaver`, spare promoted in place
        t0 = time.time()
        client.submit(
            f"#!/bin/bash\n#SBATCH -p high -w {tasks[leaver][1]} --exclusive\n"
            f"#SBATCH -o {tmp_path}/logs/high.out\nsleep 5\n"
        )
        promoted = wait_for(
            lambda: (m := current_members(tmp_path, 3, t0)) and leaver not in m and m,
            120,
            f"the spare promoted in place\n{logs(tmp_path)}",
        )
        assert keep in promoted and victim in promoted, (start, promoted)
        (spare_pid,) = set(promoted) - set(start)

        # 2. hard loss: the victim's node is gone for the job (agent and worker SIGKILLed)
        victim_agent = parent_of(victim)
        t1 = time.time()
        for pid in (victim_agent, victim):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        after_loss = wait_for(
            lambda: current_members(tmp_path, 2, t1),
            120,
            f"the survivors to re-form after the loss\n{logs(tmp_path)}",
        )
        assert set(after_loss) == {keep, spare_pid}, (after_loss, keep, spare_pid)
        t2 = time.time()

        # 3. the requeued task joins in place
        rejoined = wait_for(
            lambda: current_members(tmp_path, 3, t2),
            400,
            f"the requeued task to rejoin\n{logs(tmp_path)}",
        )
        assert {keep, spare_pid} < set(rejoined), rejoined
        (joiner,) = set(rejoined) - {keep, spare_pid}
        assert task_of(joiner)[0] == tasks[leaver][0], "the joiner is the preempted task"
        (tmp_path / "release").touch()  # every change is done: the rest at full speed

        infos = wait_for(
            lambda: (i := client.job_infos(job)) and all(x.state in TERMINAL for x in i) and i,
            500,
            f"the run to finish\n{logs(tmp_path)}",
        )
        states = {i.array_task_id: i.state for i in infos}
        killed = tasks[victim][0]
        assert states.pop(killed) != JobState.COMPLETED, "the killed task cannot complete"
        assert set(states.values()) == {JobState.COMPLETED}, infos
    finally:
        client.cancel(job)

    records = ledger(tmp_path)
    last_step = max(r["step"] for r in records)
    last = {r["pid"] for r in records if r["step"] == last_step}
    # `keep` trained through the leave, the promotion, the loss and the join in one
    # process; the promoted spare from its promotion to the end
    assert {keep, spare_pid, joiner} == last, (last, keep, spare_pid, joiner)
    rounds_per_step: dict[int, set[int]] = {}
    first_at: dict[int, float] = {}
    for r in records:
        rounds_per_step.setdefault(r["step"], set()).add(r["round"])
        first_at[r["step"]] = min(first_at.get(r["step"], r["time"]), r["time"])
    redone = {s for s, v in rounds_per_step.items() if len(v) > 1}
    # nothing redone before the hard loss (graceful leave + promotion) or after it
    # (the join); the loss redoes at most the step in flight (commit every step)
    assert all(t1 - 5 <= first_at[s] <= t2 for s in redone), sorted(redone)
    assert len(redone) <= 2, sorted(redone)
    assert_ledger_ok(tmp_path / "ledger.jsonl", DATASET)
    # the own loop's tolerance (tests/live/test_own_loop.py): GradScaler, two optimizers
    reference = reference_params(tmp_path, train_args, OWN_LOOP)
    assert_close_params(tmp_path / "params.pt", reference, rtol=1e-4, atol=1e-5)


def test_a_failed_reform_falls_back_to_the_restart_path_on_slurm(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Hard loss on a 2-task array whose workers give the new round only 0.5 s: the
    victim's worker is killed while its agent is frozen (no link ends: the eviction waits
    for the heartbeat window), so re-forming in place times out; the survivor's workers
    exit and its agent restarts them from the newest checkpoint (the restart path), and
    the run still completes exactly. (A killed agent is evicted at once by its link.)"""
    client = slurm_cluster.client
    wait_idle_nodes(client, 2)
    train_args = [
        "--steps", "400", "--dataset-size", str(DATASET), "--global-batch", "12",
        # paced until the fallback: 400 x 0.2 s is the time it may take
        "--save-every", "20", "--step-time", "0.2", "--reform-timeout", "0.5",
        "--out", str(tmp_path / "params.pt"), "--ledger", str(tmp_path / "ledger.jsonl"),
        "--pace-until-file", str(tmp_path / "release"),  # paced until the fallback is seen
    ]  # fmt: skip
    values = job_values(
        tmp_path, "elastic_array", train_args, nnodes="1:2", nproc_per_node=1,
        cpus_per_task=2, partition="low", max_restarts=2,
    )  # fmt: skip
    job = client.submit(render("elastic_array", values))
    try:
        start = wait_for(
            lambda: (m := current_members(tmp_path, 2, 0)) and max(r["step"] for r in ledger(tmp_path)) >= 40 and m,
            400,
            f"2 members training\n{logs(tmp_path)}",
        )  # fmt: skip
        keep, victim = sorted(start, key=lambda p: start[p])  # rank 0's node hosts the store
        keep_task = task_of(keep)[0]
        victim_agent = parent_of(victim)
        t1 = time.time()
        for pid, sig in ((victim_agent, signal.SIGSTOP), (victim, signal.SIGKILL)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        try:
            after = wait_for(
                lambda: current_members(tmp_path, 1, t1),
                180,
                f"the survivor to train again alone\n{logs(tmp_path)}",
            )
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim_agent, signal.SIGKILL)  # its task ends; the survivor goes on
        (tmp_path / "release").touch()  # the rest only has to finish
        (survivor,) = after
        assert survivor != keep, "the fallback restarts the workers: a new process"
        assert task_of(survivor)[0] == keep_task, "restarted by the surviving task's agent"
        infos = wait_for(
            lambda: (i := client.job_infos(job)) and all(x.state in TERMINAL for x in i) and i,
            400,
            f"the run to finish\n{logs(tmp_path)}",
        )
        states = [i.state for i in infos]
        assert JobState.COMPLETED in states, infos
    finally:
        client.cancel(job)

    records = ledger(tmp_path)
    last_step = max(r["step"] for r in records)
    assert {r["pid"] for r in records if r["step"] == last_step} == {survivor}
    # resumed from a checkpoint: the steps since the newest save (every 20) are redone
    first_after = min(r["step"] for r in records if r["pid"] == survivor)
    done_before = max(r["step"] for r in records if r["time"] < t1)
    assert done_before - 21 <= first_after - 1 <= done_before, (first_after, done_before)
    assert_ledger_ok(tmp_path / "ledger.jsonl", DATASET)
    assert max_abs_diff(tmp_path / "params.pt", reference_params(tmp_path, train_args)) < ATOL
