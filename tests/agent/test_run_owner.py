"""A run id taken from a job id belongs to the cluster and submission whose job first used it.

Clusters that share a filesystem number their jobs independently: a job of one can get
the id of an earlier job of another that ran in the same directory. Real files in a real
private directory; the two clusters are two values of ``SLURM_CLUSTER_NAME`` (a second
cluster cannot run here), given to the agent's real start-up step.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from slurm_elastic.agent import launch
from slurm_elastic.agent.run_owner import check_run_cluster
from slurm_elastic.config import ElasticConfig, load_config
from slurm_elastic.errors import RunIdInUseError, UnsafeDirectoryError
from slurm_elastic.privatefs import ensure_private_dir
from slurm_elastic.slurm.env import SlurmEnv


def keys(tmp_path: Path) -> Path:
    return ensure_private_dir(tmp_path / ".keys", root=tmp_path)


def test_the_first_agent_records_its_cluster_and_the_others_of_it_pass(tmp_path: Path) -> None:
    directory = keys(tmp_path)
    errors: list[BaseException] = []

    def agent() -> None:
        try:
            check_run_cluster(directory, "4242", "alpha")
        except BaseException as exc:  # collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=agent) for _ in range(8)]  # the nodes start at once
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert [p.name for p in directory.iterdir() if p.name.endswith(".owner")] == ["4242.owner"]
    check_run_cluster(directory, "4242", "alpha")  # a requeued task: the same cluster


def test_an_agent_of_another_cluster_is_refused_with_the_fix(tmp_path: Path) -> None:
    directory = keys(tmp_path)
    check_run_cluster(directory, "4242", "alpha")
    with pytest.raises(RunIdInUseError) as err:
        check_run_cluster(directory, "4242", "beta")
    message = str(err.value)
    assert "'alpha'" in message and "'beta'" in message
    assert "give this job its own run_id or state_dir" in message
    check_run_cluster(directory, "4243", "beta")  # another run id is another run


def test_without_a_cluster_name_nothing_is_recorded(tmp_path: Path) -> None:
    directory = keys(tmp_path)
    check_run_cluster(directory, "4242", None)
    assert list(directory.iterdir()) == []


def test_a_federated_job_id_is_not_checked(tmp_path: Path) -> None:
    """A federation's ids are unique across its clusters and a requeued federated job may
    run on a sibling: the id of origin cluster 1 (``1 << 26`` and up) is never refused."""
    directory = keys(tmp_path)
    federated = str((1 << 26) + 42)
    check_run_cluster(directory, federated, "alpha")
    check_run_cluster(directory, federated, "beta")  # requeued onto a sibling cluster
    assert list(directory.iterdir()) == []


def test_a_damaged_or_linked_record_is_refused(tmp_path: Path) -> None:
    directory = keys(tmp_path)
    (directory / "1.owner").write_text("{not json")
    os.chmod(directory / "1.owner", 0o600)
    with pytest.raises(UnsafeDirectoryError, match="damaged"):
        check_run_cluster(directory, "1", "alpha")
    elsewhere = tmp_path / "other.json"
    elsewhere.write_text('{"cluster": "alpha"}')
    os.symlink(elsewhere, directory / "2.owner")
    with pytest.raises(UnsafeDirectoryError, match=r"2\.owner"):
        check_run_cluster(directory, "2", "alpha")


def _config(tmp_path: Path, slurm: SlurmEnv, **overrides: str) -> ElasticConfig:
    return load_config(
        environ={"PWD": str(tmp_path)},
        slurm=slurm,
        overrides={"state_dir": str(tmp_path / ".slurm_elastic"), **overrides},
    )


def test_an_agent_of_another_cluster_stops_before_anything_of_the_run_is_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent's start-up step: the job of cluster alpha ran here as job 4242; job 4242
    of cluster beta stops with the reason instead of taking alpha's run and checkpoints."""
    alpha = SlurmEnv(job_id="4242", cluster_name="alpha")
    assert launch._prepare_run_files(_config(tmp_path, alpha), None, alpha)
    beta = SlurmEnv(job_id="4242", cluster_name="beta")
    with caplog.at_level(logging.ERROR, logger="slurm_elastic.agent.launch"):
        ok = launch._prepare_run_files(_config(tmp_path, beta), None, beta)
    assert not ok
    assert "a job of cluster 'alpha'" in caplog.text
    # A run id the user chose is theirs to reuse (e.g. to continue across submissions).
    chosen = _config(tmp_path, beta, run_id="4242-continued")
    assert launch._prepare_run_files(chosen, None, beta)
    owners = sorted(p.name for p in (tmp_path / ".slurm_elastic").rglob("*.owner"))
    assert owners == ["4242.owner"], owners  # not checked, not recorded


FIRST, SECOND = "0123456789abcdef", "fedcba9876543210"


def test_a_job_of_another_submission_with_the_same_id_is_refused(tmp_path: Path) -> None:
    """One cluster whose controller restarted its job ids: job 4242 of a new submission
    is not the earlier job 4242 requeued. A requeued task keeps its submission's id."""
    directory = keys(tmp_path)
    check_run_cluster(directory, "4242", "alpha", FIRST)
    check_run_cluster(directory, "4242", "alpha", FIRST)  # a requeued task, another node
    with pytest.raises(RunIdInUseError) as err:
        check_run_cluster(directory, "4242", "alpha", SECOND)
    message = str(err.value)
    assert FIRST in message and SECOND in message
    assert "restarts its job ids" in message and "its own run_id or state_dir" in message


def test_a_job_sent_without_a_submission_id_is_not_judged_by_it(tmp_path: Path) -> None:
    """Plain sbatch (no id) on either side: nothing tells the jobs apart, as before."""
    directory = keys(tmp_path)
    check_run_cluster(directory, "1", "alpha", FIRST)
    check_run_cluster(directory, "1", "alpha", None)
    check_run_cluster(directory, "2", "alpha", None)
    check_run_cluster(directory, "2", "alpha", FIRST)
    # Outside Slurm's cluster names (or a federated id) the submission still decides.
    check_run_cluster(directory, "3", None, FIRST)
    with pytest.raises(RunIdInUseError):
        check_run_cluster(directory, "3", None, SECOND)


def test_a_malformed_submission_id_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"SLURM_ELASTIC_SUBMISSION='\.\./x' is not"):
        check_run_cluster(keys(tmp_path), "1", "alpha", "../x")


def test_an_agent_of_another_submission_stops_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent's start-up step reads the id from its environment."""
    slurm = SlurmEnv(job_id="77", cluster_name="alpha")
    first = {"SLURM_ELASTIC_SUBMISSION": FIRST}
    assert launch._prepare_run_files(_config(tmp_path, slurm), None, slurm, first)
    second = {"SLURM_ELASTIC_SUBMISSION": SECOND}
    with caplog.at_level(logging.ERROR, logger="slurm_elastic.agent.launch"):
        assert not launch._prepare_run_files(_config(tmp_path, slurm), None, slurm, second)
    assert "another submission" in caplog.text
