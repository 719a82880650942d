"""Parsers of Slurm output, tested on output recorded from a real Slurm 22.05.

The files under tests/data/slurm/ were recorded from the local cluster
(scripts/slurm-cluster up; scripts/slurm/record-test-data), except the sacct table
below: sacct needs slurmdbd, which the local cluster does not run, so that sample is
written by hand in the documented ``--parsable2`` format and says so.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from slurm_elastic.errors import SlurmCommandNotFoundError, SlurmError
from slurm_elastic.slurm.commands import SlurmClient
from slurm_elastic.slurm.jobstate import STATE_TABLE, JobState, job_state_from_slurm
from slurm_elastic.slurm.parse import (
    SlurmParseError,
    is_controller_unreachable,
    is_invalid_job,
    is_sacct_disabled,
    job_info_from_scontrol,
    parse_hostnames,
    parse_sacct,
    parse_sbatch_parsable,
    parse_scontrol_show_job,
    parse_squeue,
)

DATA = Path(__file__).resolve().parent.parent / "data" / "slurm"


def recorded(name: str) -> str:
    return (DATA / name).read_text()


# ---------------------------------------------------------------- sbatch
def test_sbatch_parsable_gives_the_job_id() -> None:
    assert parse_sbatch_parsable(recorded("sbatch_parsable.txt")) == "8"


def test_sbatch_parsable_drops_the_cluster_name() -> None:
    assert parse_sbatch_parsable("1234;cluster2\n") == "1234"


@pytest.mark.parametrize("text", ["", "\n", "Submitted batch job 12\n", "abc;x"])
def test_sbatch_parsable_rejects_other_output(text: str) -> None:
    with pytest.raises(SlurmParseError, match="expected a job id"):
        parse_sbatch_parsable(text)


def test_parse_errors_are_slurm_errors_and_value_errors() -> None:
    with pytest.raises(SlurmError):
        parse_sbatch_parsable("")
    with pytest.raises(ValueError):
        parse_sbatch_parsable("")


# ---------------------------------------------------------------- squeue
def test_squeue_gives_one_record_per_array_task_and_job() -> None:
    infos = parse_squeue(recorded("squeue_array.txt"))
    by_ref = {i.ref: i for i in infos}
    assert sorted(by_ref) == ["10", "11", "9_0", "9_1", "9_2", "9_3"]
    assert by_ref["9_2"].job_id == "15"
    assert by_ref["9_2"].array_job_id == "9"
    assert by_ref["9_2"].state is JobState.RUNNING
    assert by_ref["9_3"].node_list == "node3"
    assert by_ref["10"].array_job_id is None
    assert by_ref["10"].node_list == "node[3-4]"
    assert by_ref["11"].state is JobState.PENDING
    assert by_ref["11"].reason == "PartitionNodeLimit"
    assert by_ref["11"].node_list == ""
    assert all(i.restarts is None and i.source == "squeue" for i in infos)


def test_squeue_job_name_may_contain_the_separator() -> None:
    (info,) = parse_squeue("5|5|5|N/A|RUNNING|None|low|node1|a|b name\n")
    assert info.job_id == "5"
    assert info.partition == "low"


def test_squeue_rejects_a_short_line() -> None:
    with pytest.raises(SlurmParseError, match="fields"):
        parse_squeue("5|RUNNING\n")


# ---------------------------------------------------------------- scontrol show job
def test_scontrol_values_keep_their_spaces() -> None:
    (record,) = parse_scontrol_show_job(recorded("scontrol_show_job_spaces.txt"))
    assert record["JobName"] == "name with spaces"
    assert record["Comment"] == "a comment = with eq"
    assert record["NumNodes"] == "2"
    assert record["NodeList"] == "node[3-4]"
    # keys with '/' and ':' and an empty last value
    assert record["CPUs/Task"] == "1"
    assert record["ReqB:S:C:T"] == "0:0:*:*"
    assert record["AllocNode:Sid"].startswith("localhost:")
    assert record["Power"] == ""


def test_scontrol_array_job_lists_every_task() -> None:
    records = parse_scontrol_show_job(recorded("scontrol_show_job_array.txt"))
    infos = [job_info_from_scontrol(r) for r in records]
    assert sorted(i.ref for i in infos) == ["9_0", "9_1", "9_2", "9_3"]
    assert {i.array_job_id for i in infos} == {"9"}
    assert {i.job_id for i in infos} == {"9", "13", "14", "15"}
    assert all(i.state is JobState.RUNNING and i.restarts == 0 for i in infos)


def test_scontrol_requeued_task_is_pending_with_one_restart() -> None:
    (record,) = parse_scontrol_show_job(recorded("scontrol_show_job_requeued.txt"))
    info = job_info_from_scontrol(record)
    assert info.ref == "9_1"
    assert info.state is JobState.PENDING
    assert info.reason == "BeginTime"
    assert info.restarts == 1
    assert not info.state.is_terminal


@pytest.mark.parametrize(
    ("name", "state", "terminal", "exit_code"),
    [
        ("scontrol_show_job_pending.txt", JobState.PENDING, False, "0:0"),
        ("scontrol_show_job_completed.txt", JobState.COMPLETED, True, "0:0"),
        ("scontrol_show_job_failed.txt", JobState.FAILED, True, "3:0"),
        ("scontrol_show_job_cancelled.txt", JobState.CANCELLED, True, "0:15"),
    ],
)
def test_scontrol_job_states(name: str, state: JobState, terminal: bool, exit_code: str) -> None:
    (record,) = parse_scontrol_show_job(recorded(name))
    info = job_info_from_scontrol(record)
    assert info.state is state
    assert info.state.is_terminal is terminal
    assert info.exit_code == exit_code
    assert info.source == "scontrol"


def test_scontrol_pending_job_has_no_nodes() -> None:
    (record,) = parse_scontrol_show_job(recorded("scontrol_show_job_pending.txt"))
    info = job_info_from_scontrol(record)
    assert info.node_list == ""
    assert info.reason == "PartitionNodeLimit"
    assert info.array_job_id is None
    assert info.ref == info.job_id


def test_scontrol_rejects_output_without_oneliner() -> None:
    with pytest.raises(SlurmParseError, match="oneliner"):
        parse_scontrol_show_job("   UserId=root(0)\nnot a record\n")


def test_scontrol_record_without_state_is_rejected() -> None:
    with pytest.raises(SlurmParseError, match="JobState"):
        job_info_from_scontrol({"JobId": "3"})


# ---------------------------------------------------------------- sacct
# NOT recorded (no slurmdbd on the local cluster): written in sacct's documented
# --parsable2 layout for --format=JobID,JobIDRaw,State,ExitCode,Partition,NodeList,Reason.
SACCT_SAMPLE = """\
20|20|COMPLETED|0:0|low|node1|None
20.batch|20.batch|COMPLETED|0:0||node1|
21_0|22|CANCELLED by 0|0:15|low|node2|None
21_0.batch|22.batch|CANCELLED|0:15||node2|
21_1|21|REQUEUED|0:0|low|node3|None
21_[2-3]|21|PENDING|0:0|low|None assigned|BeginTime
"""


def test_sacct_skips_steps_and_reads_array_tasks() -> None:
    infos = parse_sacct(SACCT_SAMPLE)
    assert [i.ref for i in infos] == ["20", "21_0", "21_1", "21"]
    assert infos[1].job_id == "22"
    assert infos[1].state is JobState.CANCELLED
    assert infos[2].state is JobState.REQUEUED
    assert infos[3].array_task_id is None  # several pending tasks in one record
    assert infos[3].reason == "BeginTime"


def test_sacct_rejects_wrong_field_count() -> None:
    with pytest.raises(SlurmParseError, match="fields"):
        parse_sacct("20|COMPLETED\n")


# ---------------------------------------------------------------- error detection
def test_sacct_disabled_is_detected() -> None:
    assert is_sacct_disabled(recorded("sacct_disabled_stderr.txt"))
    assert not is_sacct_disabled(recorded("scontrol_invalid_job_stderr.txt"))


@pytest.mark.parametrize("name", ["sbatch_unreachable_stderr.txt", "squeue_unreachable_stderr.txt"])
def test_unreachable_controller_is_detected(name: str) -> None:
    assert is_controller_unreachable(recorded(name))


def test_invalid_job_is_detected_and_not_taken_for_an_unreachable_controller() -> None:
    text = recorded("scontrol_invalid_job_stderr.txt")
    assert is_invalid_job(text)
    assert not is_controller_unreachable(text)


def test_hostnames_one_per_line() -> None:
    assert parse_hostnames(recorded("scontrol_show_hostnames.txt")) == [
        "n1", "n2", "n3", "n5", "r1n3", "r1n4", "r2n3", "r2n4",
    ]  # fmt: skip


# ---------------------------------------------------------------- states
def test_every_state_in_the_table_maps_and_unknown_strings_do_not_fail() -> None:
    assert {state for state in STATE_TABLE.values()} == set(JobState) - {JobState.UNKNOWN}
    assert job_state_from_slurm("CANCELLED by 0") is JobState.CANCELLED
    assert job_state_from_slurm("RUNNING+COMPLETING") is JobState.RUNNING
    assert job_state_from_slurm("cd") is JobState.COMPLETED
    assert job_state_from_slurm("SOMETHING_NEW") is JobState.UNKNOWN


@pytest.mark.parametrize(
    ("state", "terminal"),
    [
        (JobState.PENDING, False),
        (JobState.RUNNING, False),
        (JobState.REQUEUED, False),
        (JobState.REQUEUE_HOLD, False),
        (JobState.COMPLETING, False),
        (JobState.SUSPENDED, False),
        (JobState.COMPLETED, True),
        (JobState.FAILED, True),
        (JobState.CANCELLED, True),
        (JobState.TIMEOUT, True),
        (JobState.NODE_FAIL, True),
        (JobState.OUT_OF_MEMORY, True),
        (JobState.PREEMPTED, True),
    ],
)
def test_is_terminal(state: JobState, terminal: bool) -> None:
    assert state.is_terminal is terminal


# ---------------------------------------------------------------- the seam without Slurm
def test_missing_binary_names_it_and_hints_at_installing(tmp_path: Path) -> None:
    # Real subprocess; PATH points at an empty directory, so sbatch cannot be found.
    client = SlurmClient(env={"PATH": str(tmp_path)})
    with pytest.raises(SlurmCommandNotFoundError, match=r"'sbatch' was not found.*slurm-client"):
        client.submit("#!/bin/sh\ntrue\n")
    with pytest.raises(SlurmCommandNotFoundError, match="scontrol"):
        client.check()


def test_replayed_controller_failure_maps_to_controller_error() -> None:
    # A recorded-output replay at the subprocess seam: a dead controller takes ~9 s per
    # call on a real cluster; tests/slurm/ covers that path for real once.
    from slurm_elastic.errors import SlurmControllerError

    def runner(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 1, "", recorded("squeue_unreachable_stderr.txt"))

    with pytest.raises(SlurmControllerError, match="could not reach the Slurm controller"):
        SlurmClient(runner=runner).queue()
