"""Pure parsers for what Slurm's client commands print.

No subprocesses here: :mod:`slurm_elastic.slurm.commands` runs the commands and hands
their text to these functions, which are unit-tested on output recorded from a real
Slurm 22.05 (``tests/data/slurm/``, recorded by ``scripts/slurm/record-test-data``).

Formats:

* ``sbatch --parsable``: ``<jobid>`` or ``<jobid>;<cluster>``.
* ``squeue --noheader --array --format=SQUEUE_FORMAT``: ``|``-separated, one line per
  job or array task (job name last, so a ``|`` in a name cannot shift columns).
* ``scontrol show job --oneliner``: one line per job, ``Key=Value`` pairs separated by
  spaces, where values may themselves contain spaces (``JobName=my job``). A value
  runs until the next `` Key=`` token. (A value that itself contains `` word=`` is
  ambiguous in Slurm's format; such a tail is read as a separate key.)
* ``sacct --parsable2 --noheader --format=SACCT_FORMAT``: ``|``-separated; job steps
  (``12.batch``, ``12.0``) are skipped.
"""

from __future__ import annotations

import re

from slurm_elastic.errors import SlurmParseError
from slurm_elastic.slurm.jobstate import JobInfo, job_state_from_slurm

__all__ = [
    "SACCT_FIELDS",
    "SACCT_FORMAT",
    "SQUEUE_FIELDS",
    "SQUEUE_FORMAT",
    "SlurmParseError",
    "is_controller_unreachable",
    "is_invalid_job",
    "is_sacct_disabled",
    "job_info_from_scontrol",
    "parse_hostnames",
    "parse_sacct",
    "parse_sbatch_parsable",
    "parse_scontrol_show_job",
    "parse_squeue",
]


#: squeue fields, in order: job or task id, own job id, array job id, array task id,
#: long state, reason, partition, node list, job name.
SQUEUE_FIELDS = (
    "id",
    "job_id",
    "array_job_id",
    "array_task_id",
    "state",
    "reason",
    "partition",
    "node_list",
    "name",
)
SQUEUE_FORMAT = "%i|%A|%F|%K|%T|%r|%P|%N|%j"

#: sacct fields, in order (``--format`` value is SACCT_FORMAT).
SACCT_FIELDS = ("JobID", "JobIDRaw", "State", "ExitCode", "Partition", "NodeList", "Reason")
SACCT_FORMAT = ",".join(SACCT_FIELDS)

_SCONTROL_KEY = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_/:]*)=")
_CONTROLLER_DOWN = (
    "unable to contact slurm controller",
    "slurm backup controller in standby mode",
    "socket timed out on send/recv operation",
    "zero bytes were transmitted or received",
    "unable to process configuration file",
    "could not establish a configuration source",
)


def parse_sbatch_parsable(text: str) -> str:
    """Return the job id from ``sbatch --parsable`` output.

    Args:
        text: standard output of ``sbatch --parsable`` (``"12\\n"`` or ``"12;cluster\\n"``).

    Raises:
        SlurmParseError: the last line is not ``<digits>[;cluster]``.
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    job_id = lines[-1].split(";", 1)[0] if lines else ""
    if not job_id.isdigit():
        raise SlurmParseError(
            f"sbatch --parsable printed {text!r}, expected a job id such as '12' or "
            "'12;cluster'; check that sbatch is Slurm's and that --parsable is supported"
        )
    return job_id


def _none_if_na(value: str) -> str | None:
    return None if value in ("", "N/A", "(null)", "None") else value


def parse_squeue(text: str) -> list[JobInfo]:
    """Parse ``squeue --noheader --array --format=SQUEUE_FORMAT`` output.

    Args:
        text: standard output of that command.

    Returns:
        One :class:`JobInfo` per line (``restarts`` is ``None``: squeue does not say).

    Raises:
        SlurmParseError: a line has fewer fields than :data:`SQUEUE_FIELDS`.
    """
    infos: list[JobInfo] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|", len(SQUEUE_FIELDS) - 1)
        if len(parts) != len(SQUEUE_FIELDS):
            raise SlurmParseError(
                f"squeue line {line!r} has {len(parts)} fields, expected "
                f"{len(SQUEUE_FIELDS)} for --format={SQUEUE_FORMAT!r}"
            )
        row = dict(zip(SQUEUE_FIELDS, parts, strict=True))
        array_job = _none_if_na(row["array_job_id"])
        task = _none_if_na(row["array_task_id"])
        # A non-array job prints its own id as %F and N/A as %K.
        is_array = task is not None
        infos.append(
            JobInfo(
                job_id=row["job_id"],
                state=job_state_from_slurm(row["state"]),
                array_job_id=array_job if is_array else None,
                array_task_id=task if task is not None and task.isdigit() else None,
                reason=_none_if_na(row["reason"]),
                node_list=row["node_list"].strip(),
                partition=row["partition"].strip(),
                source="squeue",
            )
        )
    return infos


def parse_scontrol_show_job(text: str) -> list[dict[str, str]]:
    """Parse ``scontrol show job --oneliner`` output into one dict per job.

    Args:
        text: standard output; one job per non-empty line.

    Returns:
        For each line, ``{key: value}`` with values stripped (spaces inside kept).

    Raises:
        SlurmParseError: a line does not start with a ``Key=`` token.
    """
    records: list[dict[str, str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        matches = list(_SCONTROL_KEY.finditer(line))
        if not matches or matches[0].start() != 0:
            raise SlurmParseError(
                f"scontrol show job line {line[:80]!r} does not start with Key=Value; "
                "was --oneliner (-o) passed?"
            )
        record: dict[str, str] = {}
        for match, following in zip(matches, [*matches[1:], None], strict=True):
            end = following.start() if following is not None else len(line)
            record[match.group(1)] = line[match.end() : end].strip()
        records.append(record)
    return records


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value is not None and value.strip().isdigit() else None


def job_info_from_scontrol(record: dict[str, str]) -> JobInfo:
    """Build a :class:`JobInfo` from one :func:`parse_scontrol_show_job` record.

    Raises:
        SlurmParseError: the record has no ``JobId`` or ``JobState``.
    """
    if "JobId" not in record or "JobState" not in record:
        raise SlurmParseError(
            f"scontrol record lacks JobId/JobState (keys: {sorted(record)[:10]}...)"
        )
    task = _none_if_na(record.get("ArrayTaskId", ""))
    return JobInfo(
        job_id=record["JobId"],
        state=job_state_from_slurm(record["JobState"]),
        array_job_id=_none_if_na(record.get("ArrayJobId", "")),
        array_task_id=task if task is not None and task.isdigit() else None,
        reason=_none_if_na(record.get("Reason", "")),
        restarts=_int_or_none(record.get("Restarts")),
        node_list=(_none_if_na(record.get("NodeList", "")) or ""),
        partition=record.get("Partition", ""),
        exit_code=record.get("ExitCode", ""),
        source="scontrol",
    )


def parse_sacct(text: str) -> list[JobInfo]:
    """Parse ``sacct --parsable2 --noheader --format=SACCT_FORMAT`` output.

    Job steps (``12.batch``, ``12.extern``, ``12.0``) are skipped; an array task
    ``12_3`` keeps its own id from ``JobIDRaw``.

    Raises:
        SlurmParseError: a line has a different number of fields than requested.
    """
    infos: list[JobInfo] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|")
        if len(parts) != len(SACCT_FIELDS):
            raise SlurmParseError(
                f"sacct line {line!r} has {len(parts)} fields, expected "
                f"{len(SACCT_FIELDS)} for --format={SACCT_FORMAT!r}"
            )
        row = dict(zip(SACCT_FIELDS, parts, strict=True))
        job = row["JobID"]
        if "." in job:
            continue
        array_job: str | None = None
        task: str | None = None
        if "_" in job:
            array_job, task = job.split("_", 1)
        infos.append(
            JobInfo(
                job_id=row["JobIDRaw"].split(".", 1)[0] or job,
                state=job_state_from_slurm(row["State"]),
                array_job_id=array_job,
                array_task_id=task if task is not None and task.isdigit() else None,
                reason=_none_if_na(row["Reason"]),
                node_list=(_none_if_na(row["NodeList"]) or ""),
                partition=row["Partition"],
                exit_code=row["ExitCode"],
                source="sacct",
            )
        )
    return infos


def parse_hostnames(text: str) -> list[str]:
    """Parse ``scontrol show hostnames`` output (one host per line)."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def is_sacct_disabled(text: str) -> bool:
    """True when sacct says there is no accounting storage (no slurmdbd)."""
    return "accounting storage is disabled" in text.lower()


def is_controller_unreachable(text: str) -> bool:
    """True when a command's output says slurmctld cannot be reached or configured."""
    low = text.lower()
    return any(marker in low for marker in _CONTROLLER_DOWN)


def is_invalid_job(text: str) -> bool:
    """True when Slurm says the job id is unknown (never existed, or purged)."""
    low = text.lower()
    return "invalid job id" in low
