"""SlurmEnv: a pure parse of SLURM_* (recorded from the local cluster's jobs)."""

from pathlib import Path

import pytest

from slurm_elastic.errors import SlurmEnvError
from slurm_elastic.slurm.env import SlurmEnv

# Variables as printed by `env` inside a 2-node batch step on the local cluster (netns mode).
TWO_NODE_STEP = {
    "SLURM_JOB_ID": "7",
    "SLURM_JOBID": "7",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
    "SLURMD_NODENAME": "node2",
    "SLURM_CPUS_ON_NODE": "2",
    "SLURM_JOB_PARTITION": "low",
    "SLURM_SUBMIT_DIR": "/work/main",
    "SLURM_JOB_NAME": "wrap",
}

ARRAY_TASK_REQUEUED = {
    "SLURM_JOB_ID": "12",
    "SLURM_ARRAY_JOB_ID": "10",
    "SLURM_ARRAY_TASK_ID": "2",
    "SLURM_RESTART_COUNT": "1",
    "SLURM_JOB_NODELIST": "node3",
    "SLURMD_NODENAME": "node3",
    "SLURM_GPUS_ON_NODE": "4",
}


def test_two_node_step() -> None:
    env = SlurmEnv.from_environ(TWO_NODE_STEP)
    assert env.in_slurm and not env.is_array_task
    assert env.nodelist == ("node1", "node2")
    assert (env.num_nodes, env.node_id, env.procid) == (2, 1, 1)
    assert env.node_name == "node2"
    assert env.cpus_on_node == 2 and env.gpus_per_node is None
    assert env.submit_dir == Path("/work/main")
    assert env.restart_count == 0  # unset on a first run, not "0"
    assert env.run_id == "7" and env.own_job_ref == "7"


def test_array_task_uses_array_job_id_as_run_id_and_own_task_as_requeue_ref() -> None:
    env = SlurmEnv.from_environ(ARRAY_TASK_REQUEUED)
    assert env.is_array_task
    assert env.run_id == "10"
    assert env.own_job_ref == "10_2"
    assert env.restart_count == 1
    assert env.gpus_per_node == 4


@pytest.mark.parametrize(
    ("raw", "count"),
    [("4", 4), ("gpu:2", 2), ("a100:8", 8), ("gpu:a100:4(IDX:0-3)", 4), ("2,2", 2)],
)
def test_gpu_forms(raw: str, count: int) -> None:
    assert SlurmEnv.from_environ({"SLURM_GPUS_ON_NODE": raw}).gpus_per_node == count


def test_outside_slurm_everything_is_empty() -> None:
    env = SlurmEnv.from_environ({"HOME": "/root"})
    assert not env.in_slurm
    assert env.run_id is None and env.own_job_ref is None and env.nodelist == ()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SLURM_NODEID": "one"}, "SLURM_NODEID='one' is not an integer"),
        ({"SLURM_RESTART_COUNT": "-1"}, "must not be negative"),
        ({"SLURM_JOB_NODELIST": "n[1-"}, "unbalanced"),
        ({"SLURM_GPUS_ON_NODE": "gpu:lots"}, "has no GPU count"),
    ],
)
def test_malformed_variables_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(SlurmEnvError, match=message):
        SlurmEnv.from_environ(env)
