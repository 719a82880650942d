"""Fault matrix, Slurm and process faults: one ``elastic_array`` job (3 tasks, 1 worker
each; in place, or restart with ``FAULTS_PATH=restart``) carries the faults below in
sequence; after each one the test waits until all 3 workers train again in a later round
(requeueing a task by hand where the fault ends a task
and nothing in Slurm brings it back, as a user would), then injects the next.

Every case is its own test; each asserts its own case held, its own end state right
after its recovery (``FaultRun.check_interim``: no orphan worker, one agent per running
task, no sample twice in an epoch so far, the newest checkpoint verifies), *and* the
end invariants (tests/faults/harness.py): the job completed, the last checkpoint verifies, every sample
was used exactly once per epoch, the final parameters match an uninterrupted run, and
nothing is left in the queue or the process table.

The restart path (scripts that do not opt in to in-place changes) runs in every suite
too: ``RESTART_CASES`` on a carrier job of their own (``test_array_fault_restart_path``),
so a regression of that path fails the suite; ``FAULTS_PATH=restart`` runs every case
on it (the restart column of docs/reliability.md, ``python bench/fault_matrix.py``).
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from slurm_elastic.checkpoint import CheckpointManager
from slurm_elastic.checkpoint.manager import TMP_PREFIX
from slurm_elastic.slurm.jobstate import JobState
from tests.conftest import SlurmCluster
from tests.e2e.jobs import FAST
from tests.faults.harness import PATH, FaultRun, Scenario
from tests.helpers import wait_for

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.timeout(1800),
]

TASKS = 3
RECOVER_S = 240  # a restart of the whole group under load, or a requeue + rejoin
# The bound for a frozen node: the eviction window of the job (the harness's FAST
# settings) + 5 s.
FROZEN_BOUND_S = FAST["heartbeat_interval_s"] * FAST["heartbeat_miss_limit"] + 5.0
NO_SCONTROL_TASK = 2  # this task's PATH has no Slurm commands (as in a container)
RUNNING = {JobState.RUNNING}


def _foreign_jobs_on(run: FaultRun, node: str) -> list[str]:
    out = run.cluster.client.run(["squeue", "-h", "-w", node, "-o", "%i"]).stdout.split()
    return [j for j in out if not j.startswith(f"{run.job}_") and j not in run.extra_jobs]


def _node_of_task(run: FaultRun, task: int) -> str:
    return run.task_info(task).node_list


def _recovered(run: FaultRun, since: float, what: str) -> None:
    run.wait_training(TASKS, since, RECOVER_S, f"recovery after {what}", new_round=True)


def _evicted_by_link(run: FaultRun, since: float) -> None:
    """A killed agent is evicted by its watcher's link, not after the heartbeat window."""
    evicted = run.events(since, "rendezvous.evicted")
    assert [e for e in evicted if e["cause"] == "link"], f"not evicted by a link: {evicted}"


def _requeue_task(run: FaultRun, task: int) -> None:
    """What a user does after a task's agent died: requeue it (Slurm keeps the script)."""
    run.wait_task(task, {s for s in JobState if s.is_terminal}, 120)
    run.cluster.client.requeue(f"{run.job}_{task}")


def _scenario(run: FaultRun, sc: Scenario, cases: Sequence[str]) -> None:
    cl = run.cluster.client
    t_start = time.time()
    run.submit()
    _recovered(run, t_start, "the start")
    wait_for(lambda: run.step_now() >= 15, 120, "the first checkpoints", interval=0.2)

    def worker_sigkill() -> None:
        t0 = time.time()
        run.kill(run.workers()[-1])
        _recovered(run, t0, "a worker SIGKILL")
        # the killed worker's agent restarts it (on both paths); the survivors restart
        # too (restart path) or re-form in place around the new worker (in place)
        assert run.events(t0, "agent.restart"), "no agent.restart event after the kill"
        resumed = [e["step"] for e in run.events(t0, "train.start")]
        assert min(resumed) > 0, "resumed from scratch, not from a checkpoint or a peer"
        if run.path == "in-place":
            assert run.events(t0, "live.reformed"), "the survivors did not re-form in place"

    def kill_during_checkpoint_write() -> None:
        writing = Path(f"{run.hold_file}.writing")
        writing.unlink(missing_ok=True)
        run.hold_file.touch()
        wait_for(writing.exists, 60, "a checkpoint write to be in progress", interval=0.1)
        partial = list(run.checkpoint_dir.glob(f"{TMP_PREFIX}*"))
        assert partial, "no partial checkpoint directory while writing"
        committed = {c.step for c in CheckpointManager(run.checkpoint_dir).list_checkpoints()}
        t0 = time.time()
        subprocess.run(["kill", "-9", writing.read_text().strip()], check=True)
        run.hold_file.unlink()
        _recovered(run, t0, "a kill during a checkpoint write")
        # the partial write is never loaded; on the restart path the group resumes from a
        # committed checkpoint, in place the new rank 0 gets the survivors' commit
        loaded = [e["path"] for e in run.events(t0, "checkpoint.loaded")]
        assert not [p for p in loaded if TMP_PREFIX in p], f"a partial write was loaded: {loaded}"
        resumed = min(e["step"] for e in run.events(t0, "train.start"))
        if not run.events(t0, "live.reformed"):
            assert resumed in committed, f"resumed at {resumed}, not a committed step {committed}"

    def corrupted_newest_checkpoint() -> None:
        t0 = time.time()
        for worker in run.workers():
            run.kill(worker)
        # no worker left to save: the newest committed checkpoint is the one we damage
        newest = wait_for(
            lambda: CheckpointManager(run.checkpoint_dir).latest_verified(deep=False),
            30,
            "a committed checkpoint",
        )
        data = newest.path / newest.manifest.files[0].name  # the state file (state.bin)
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
        _recovered(run, t0, "a corrupted newest checkpoint")
        skipped = [e for e in run.events(t0, "checkpoint.skipped") if e["step"] == newest.step]
        assert skipped, f"the corrupted step {newest.step} was not reported as skipped"
        resumed = min(e["step"] for e in run.events(t0, "train.start"))
        assert resumed < newest.step, f"resumed at {resumed}: the corrupted step was loaded"

    def usr2_preemption() -> None:
        t0 = time.time()
        cl.cancel(f"{run.job}_0", signal="USR2", batch=True)
        wait_for(lambda: run.events(t0, "agent.requeued"), 120, "task 0 to requeue itself")
        assert run.events(t0, "train.preempted"), "the workers did not save on the notice"
        _recovered(run, t0, "USR2")

    def sigterm_preemption() -> None:
        t0 = time.time()
        cl.cancel(f"{run.job}_1", signal="TERM", batch=True)
        wait_for(lambda: run.events(t0, "agent.terminated"), 120, "task 1's agent to stop")
        assert run.events(t0, "train.preempted"), "the workers did not save on SIGTERM"
        run.wait_world_below(TASKS, t0, RECOVER_S, "survivors after SIGTERM")
        info = run.wait_task(1, {s for s in JobState if s.is_terminal}, 120)
        assert info.exit_code.startswith("5:"), f"exit {info.exit_code}, not TERMINATED (5)"
        _requeue_task(run, 1)
        _recovered(run, t0, "SIGTERM + requeue")

    def scontrol_requeue() -> None:
        t0 = time.time()
        cl.requeue(f"{run.job}_0")
        run.wait_world_below(TASKS, t0, RECOVER_S, "survivors after scontrol requeue")
        _recovered(run, t0, "scontrol requeue")
        assert (run.task_info(0).restarts or 0) >= 2

    def agent_sigkill() -> None:
        host = run.store_host()
        victim = next(a for a in run.agents() if a.pid != host.pid)
        t0 = time.time()
        run.kill(victim)
        run.wait_world_below(TASKS, t0, RECOVER_S, "survivors after an agent SIGKILL")
        _evicted_by_link(run, t0)
        _requeue_task(run, int(victim.task or 0))
        _recovered(run, t0, "an agent SIGKILL + requeue")

    def store_host_sigkill() -> None:
        host = run.store_host()
        t0 = time.time()
        run.kill(host)
        run.wait_world_below(TASKS, t0, RECOVER_S, "survivors after the store host's SIGKILL")
        _evicted_by_link(run, t0)
        _requeue_task(run, int(host.task or 0))
        _recovered(run, t0, "the store host's SIGKILL + requeue")

    def frozen_node(store_host: bool = False) -> None:
        # A silent loss (issue 22): one task's agent and worker stopped, their sockets
        # open (a hung kernel, a frozen VM). The survivors train again at N-1 within the
        # eviction window + 5 s; thawed, the node rejoins. ``store_host``: the frozen
        # agent is the one serving the round's store (its kernel still accepts
        # connections and takes requests that nobody answers: a torch store call to it
        # blocks past its own timeout), so the survivors must form the next round
        # without ever waiting on it.
        host = run.store_host()
        victim = host if store_host else next(a for a in run.agents() if a.pid != host.pid)
        frozen = [victim, *(w for w in run.workers() if w.ppid == victim.pid)]
        t0 = time.time()
        for proc in frozen:
            run.kill(proc, signal.SIGSTOP)
        try:
            run.wait_training(
                TASKS - 1, t0, FROZEN_BOUND_S + 60, "survivors after a frozen node", new_round=True
            )
            first = wait_for(
                lambda: run.first_step_at(TASKS - 1, t0), 60, "a step at 2", interval=0.2
            )
            took = first - t0
        finally:
            for proc in frozen:
                run.kill(proc, signal.SIGCONT)
        what = "frozen store host" if store_host else "frozen node"
        print(f"{what}: the survivors trained at {TASKS - 1} {took:.2f} s after the stop")
        evicted = run.events(t0, "rendezvous.evicted")
        assert evicted and {e["cause"] for e in evicted} == {"heartbeat"}, evicted
        if run.path == "in-place":  # the bound is the in-place path's (the restart path first
            # gives the blocked workers the notice and waits shutdown_timeout_s for them)
            assert took <= FROZEN_BOUND_S, f"{took:.2f} s > eviction window + 5 s"
            assert run.events(t0, "live.collective_aborted"), "no blocked collective aborted"
        _recovered(run, t0, f"a {what}, thawed")

    def partitioned_node() -> None:
        # A partition (issue 22): one task's node cut off from its peers (its link set
        # down on the netns cluster, packets dropped, no reset) while it still reaches
        # the shared directory, so its heartbeat goes on. Its peers evict it on their
        # unanswered pings: the survivors train again at N-1 within the eviction window
        # + 5 s; the cut-off node's own join waits for the network; it rejoins after.
        host = run.store_host()
        nodes = {t: _node_of_task(run, t) for t in range(TASKS)}
        alone = [
            a for a in run.agents() if list(nodes.values()).count(nodes[int(a.task or 0)]) == 1
        ]
        if not alone:  # two 1-CPU tasks may share a node: cutting it would cut both
            pytest.skip(reason=f"no task has a node of its own: {nodes}")
        victim = next((a for a in alone if a.pid != host.pid), alone[0])
        node = nodes[int(victim.task or 0)]
        if _foreign_jobs_on(run, node):
            pytest.skip(reason=f"{node} also runs jobs of others: not cutting it")
        t0 = time.time()
        run.cluster.set_link(node, up=False)
        try:
            run.wait_training(
                TASKS - 1, t0, FROZEN_BOUND_S + 60, "survivors after a partition", new_round=True
            )
            first = wait_for(
                lambda: run.first_step_at(TASKS - 1, t0), 60, "a step at 2", interval=0.2
            )
            took = first - t0
        finally:
            run.cluster.set_link(node, up=True)
        print(f"partitioned node: the survivors trained at {TASKS - 1} {took:.2f} s after the cut")
        evicted = run.events(t0, "rendezvous.evicted")
        assert evicted and {e["cause"] for e in evicted} == {"unreachable"}, evicted
        if run.path == "in-place":
            assert took <= FROZEN_BOUND_S, f"{took:.2f} s > eviction window + 5 s"
        _recovered(run, t0, "a partitioned node, its link back")

    def preempt_node_of(task: int) -> float:
        node = _node_of_task(run, task)
        foreign = _foreign_jobs_on(run, node)
        if foreign:
            pytest.skip(reason=f"{node} also runs jobs {foreign} of others: not preempting them")
        t0 = time.time()
        run.submit_extra(
            f"#!/bin/bash\n#SBATCH -p high -w {node} --exclusive -J faults-high\n"
            f"#SBATCH -o {run.tmp}/logs/high.out\nsleep 5\n"
        )
        return t0

    def high_partition_preemption() -> None:
        # not the node of the task without scontrol (that is the last case)
        spare = _node_of_task(run, NO_SCONTROL_TASK)
        task = next((t for t in (0, 1) if _node_of_task(run, t) != spare), None)
        if task is None:
            pytest.skip(reason=f"every task shares {spare} with task {NO_SCONTROL_TASK}")
        t0 = preempt_node_of(task)
        run.wait_world_below(TASKS, t0, RECOVER_S, "survivors after preemption")
        _recovered(run, t0, "preemption by a high job")

    def node_down() -> None:
        node = _node_of_task(run, 1)
        if _foreign_jobs_on(run, node):
            pytest.skip(reason=f"{node} also runs jobs of others: not failing it")
        t0 = time.time()
        cl.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=faults-test"])
        try:
            run.wait_world_below(TASKS, t0, RECOVER_S, f"survivors after {node} went DOWN")
        finally:
            cl.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
        _recovered(run, t0, "a node DOWN")

    def scancel_task() -> None:
        t0 = time.time()
        cl.cancel(f"{run.job}_0")
        run.wait_training(
            TASKS - 1, t0, RECOVER_S, "survivors after scancel of task 0", new_round=True
        )

    def scontrol_missing() -> None:
        # tasks 1 and 2 remain; task 2 has no scontrol: its own requeue fails, and
        # Slurm's preemption requeue (PreemptMode=REQUEUE) must still bring it back
        t0 = preempt_node_of(NO_SCONTROL_TASK)
        run.wait_world_below(TASKS - 1, t0, RECOVER_S, "the survivor after preemption")
        wait_for(
            lambda: "'scontrol' was not found on PATH" in run.logs(),
            60,
            "the agent's message that scontrol is missing",
        )
        run.wait_training(
            TASKS - 1, t0, RECOVER_S, "task 2 back through Slurm's requeue", new_round=True
        )

    for name, body in [
        ("worker_sigkill", worker_sigkill),
        ("kill_during_checkpoint_write", kill_during_checkpoint_write),
        ("corrupted_newest_checkpoint", corrupted_newest_checkpoint),
        ("usr2_preemption", usr2_preemption),
        ("sigterm_preemption", sigterm_preemption),
        ("scontrol_requeue_task", scontrol_requeue),
        ("agent_sigkill", agent_sigkill),
        ("store_host_agent_sigkill", store_host_sigkill),
        ("frozen_node", frozen_node),
        ("frozen_store_host", lambda: frozen_node(store_host=True)),
        ("partitioned_node", partitioned_node),
        ("high_partition_preemption", high_partition_preemption),
        ("node_down", node_down),
        ("scancel_task", scancel_task),
        ("scontrol_missing_slurm_requeues", scontrol_missing),
    ]:
        if name in cases:
            sc.run(name, body, after=run.check_interim)

    infos = run.finish()
    states = {i.array_task_id: i.state for i in infos}
    expected = {str(t): JobState.COMPLETED for t in range(TASKS)}
    if "scancel_task" in sc.outcomes and sc.outcomes["scancel_task"] is None:
        expected["0"] = JobState.CANCELLED
    assert states == expected, f"{states}\n{run.logs()}"


def _array_run(
    slurm_cluster: SlurmCluster, tmp: Path, path: str, cases: Sequence[str]
) -> Iterator[Scenario]:
    """Submit one carrier job on ``path``, run ``cases`` on it in order, check its end."""
    if slurm_cluster.mode != "netns":
        pytest.skip(reason=f"needs the cluster in netns mode, it runs in {slurm_cluster.mode!r}")
    no_slurm = f'[ "$SLURM_ARRAY_TASK_ID" = {NO_SCONTROL_TASK} ] && export PATH=/nonexistent'
    run = FaultRun(
        slurm_cluster,
        tmp,
        steps=3000,
        values={
            "nnodes": f"1:{TASKS}",
            "nproc_per_node": 1,
            "cpus_per_task": 1,
            "setup": f"export OMP_NUM_THREADS=1\n{no_slurm}",
        },
        path=path,
    )
    sc = Scenario(diagnose=run.diagnosis)
    try:
        try:
            _scenario(run, sc, cases)
        except Exception as exc:
            sc.end_error = f"{type(exc).__name__}: {exc}"
        else:
            try:
                run.check_end(tmp.parent)
            except AssertionError as exc:
                sc.end_error = str(exc)
        yield sc
    finally:
        run.cleanup()


@pytest.fixture(scope="module")
def array_run(
    slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Scenario]:
    yield from _array_run(slurm_cluster, tmp_path_factory.mktemp("array"), PATH, CASES)


@pytest.fixture(scope="module")
def restart_array_run(
    slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Scenario]:
    if PATH == "restart":
        pytest.skip(reason="FAULTS_PATH=restart: the whole matrix runs on the restart path")
    tmp = tmp_path_factory.mktemp("array-restart")
    yield from _array_run(slurm_cluster, tmp, "restart", RESTART_CASES)


CASES = [
    "worker_sigkill",
    "kill_during_checkpoint_write",
    "corrupted_newest_checkpoint",
    "usr2_preemption",
    "sigterm_preemption",
    "scontrol_requeue_task",
    "agent_sigkill",
    "store_host_agent_sigkill",
    "frozen_node",
    "frozen_store_host",
    "partitioned_node",
    "high_partition_preemption",
    "node_down",
    "scancel_task",
    "scontrol_missing_slurm_requeues",
]


#: The restart-path column's cases that every suite runs (the path of scripts that do not
#: opt in to in-place changes: every change restarts all workers from a checkpoint): a
#: lost worker, a notice, a lost agent and a silent loss, on a carrier job of their own.
#: The whole column: ``FAULTS_PATH=restart`` (``python bench/fault_matrix.py``).
RESTART_CASES = ["worker_sigkill", "usr2_preemption", "agent_sigkill", "frozen_node"]


@pytest.mark.parametrize("case", CASES)
def test_array_fault(array_run: Scenario, case: str) -> None:
    array_run.check(case)


@pytest.mark.parametrize("case", RESTART_CASES)
def test_array_fault_restart_path(restart_array_run: Scenario, case: str) -> None:
    restart_array_run.check(case)
