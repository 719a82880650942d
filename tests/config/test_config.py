"""ElasticConfig: precedence, derived defaults, and errors that name key, value and rule."""

from pathlib import Path

import pytest

from slurm_elastic.config import ElasticConfig, load_config
from slurm_elastic.errors import ConfigError

SLURM = {
    "SLURM_JOB_ID": "41",
    "SLURM_ARRAY_JOB_ID": "40",
    "SLURM_ARRAY_TASK_ID": "1",
    "SLURMD_NODENAME": "node2",
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_SUBMIT_DIR": "/shared/proj",
}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_defaults_derived_from_slurm() -> None:
    cfg = load_config(environ=SLURM)
    assert cfg.run_id == "40"  # the array job id: shared by every node of the run
    assert cfg.nproc_per_node == 8
    assert cfg.local_addr == "node2"
    assert cfg.state_dir == Path("/shared/proj/.slurm_elastic")
    assert cfg.rdzv_dir == Path("/shared/proj/.slurm_elastic/rdzv")
    assert cfg.checkpoint_dir == Path("/shared/proj/.slurm_elastic/checkpoints/40")
    assert cfg.events_dir == Path("/shared/proj/.slurm_elastic/events/40")


def test_precedence_cli_over_env_over_yaml_over_slurm(tmp_path: Path) -> None:
    path = write(tmp_path, "nnodes: '1:4'\nnproc_per_node: 2\nmax_restarts: 7\nrun_id: fromyaml\n")
    env = {**SLURM, "SLURM_ELASTIC_MAX_RESTARTS": "5", "SLURM_ELASTIC_RUN_ID": "fromenv"}
    cfg = load_config(path, environ=env, overrides={"run_id": "fromcli", "max_nodes": None})
    assert (cfg.min_nodes, cfg.max_nodes) == (1, 4)
    assert cfg.nproc_per_node == 2  # YAML beats the value derived from GPUs
    assert cfg.max_restarts == 5  # env beats YAML
    assert cfg.run_id == "fromcli"  # CLI beats env; None means "flag not given"
    assert cfg.checkpoint_dir == Path("/shared/proj/.slurm_elastic/checkpoints/fromcli")


def test_signal_names_are_normalised() -> None:
    assert load_config(environ={}, overrides={"preempt_signal": "sigusr1"}).preempt_signal == "USR1"
    assert ElasticConfig(preempt_signal="12").preempt_signal == "USR2"


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("nnodes: '4:1'\n", r"'max_nodes' = 1: must be >= min_nodes \(4\)"),
        ("min_nodes: 0\n", r"'min_nodes' = 0: must be >= 1"),
        ("join_timeout_s: -5\n", r"'join_timeout_s' = -5.0: must be >= 0.1 seconds"),
        ("shutdown_timeout_s: 0\n", r"'shutdown_timeout_s' = 0.0: must be > 0 seconds"),
        ("max_restarts: two\n", r"'max_restarts' = 'two' from config file .*: expected int"),
        ("max_restart: 3\n", r"unknown config key 'max_restart'.*did you mean max_restarts"),
        ("requeue: sometimes\n", r"'requeue' = 'sometimes': must be one of never, preempt, always"),
        ("rdzv_backend: etcd3\n", r"'rdzv_backend' = 'etcd3'"),
        ("preempt_signal: KILL\n", r"'preempt_signal' = 'KILL': must be a catchable signal"),
        ("run_id: ../../etc\n", r"'run_id' = '../../etc'"),
        ("nnodes: many\n", r"'nnodes' = 'many': expected N or MIN:MAX"),
        ("- a\n- b\n", r"must hold a mapping"),
        ("a: [\n", r"not valid YAML"),
        ("hang_timeout_s: 0\n", r"'hang_timeout_s' = 0.0: must be > 0 seconds, or null"),
        ("nproc_per_node: 1.5\n", r"'nproc_per_node' = 1.5 .*expected int"),
    ],
)
def test_bad_yaml_is_rejected_with_key_value_and_rule(
    tmp_path: Path, yaml_text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, yaml_text), environ={})


def test_unknown_env_variable_is_rejected() -> None:
    with pytest.raises(ConfigError, match="SLURM_ELASTIC_MAXNODES='3'"):
        load_config(environ={"SLURM_ELASTIC_MAXNODES": "3"})


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml", environ={})


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        ElasticConfig(min_nodes=2, max_nodes=1)
