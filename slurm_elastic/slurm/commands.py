"""The one subprocess seam for Slurm's client commands.

Every call to ``sbatch``, ``squeue``, ``sacct``, ``scontrol`` and ``scancel`` made by
slurm_elastic goes through :class:`SlurmClient`: argument lists (never a shell), a
``timeout`` always, and one mapping from failures to the error tree:

* the binary is not on ``PATH`` -> :class:`~slurm_elastic.errors.SlurmCommandNotFoundError`
* slurmctld cannot be reached/configured -> :class:`~slurm_elastic.errors.SlurmControllerError`
* any other non-zero exit or a timeout -> :class:`~slurm_elastic.errors.SlurmCommandError`

Output is read by the pure functions of :mod:`slurm_elastic.slurm.parse`. Tests may
pass their own ``runner`` (same signature as :func:`run_subprocess`) to replay recorded
output; the real-cluster tests use the default runner.

Job state works without slurmdbd: ``sacct`` first (it knows old jobs), and when
accounting is disabled (remembered per client) or the job is not in the database yet,
``scontrol show job --oneliner``, which sees pending, running and finished jobs for
``MinJobAge`` seconds and reports ``Restarts``. ``squeue`` is used for listing the
queue (:meth:`SlurmClient.queue`); it is not consulted for a job's state because it
forgets finished tasks at once, so a half-finished array would look incomplete.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence

from slurm_elastic.errors import (
    SlurmCommandError,
    SlurmCommandNotFoundError,
    SlurmControllerError,
    SlurmJobNotFoundError,
)
from slurm_elastic.slurm.jobstate import JobInfo, JobState
from slurm_elastic.slurm.parse import (
    SACCT_FORMAT,
    SQUEUE_FORMAT,
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
from slurm_elastic.slurm.site import (
    PartitionInfo,
    SlurmVersion,
    parse_key_values,
    parse_partition,
    parse_version,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Runner",
    "SlurmClient",
    "SlurmJobNotFoundError",
    "run_subprocess",
]

logger = logging.getLogger(__name__)

#: Slurm clients retry an unreachable controller for ~9-18 s before giving up.
DEFAULT_TIMEOUT_S = 60.0

#: ``runner(argv, timeout=..., input=..., env=...) -> CompletedProcess[str]``
Runner = Callable[..., "subprocess.CompletedProcess[str]"]

_INSTALL_HINT = (
    "install the Slurm client tools (Debian/Ubuntu: apt-get install slurm-client), "
    "load them ('module load slurm'), or start the local test cluster with "
    "'scripts/slurm-cluster up' and 'source /var/tmp/slurm-elastic-cluster/env'"
)


def run_subprocess(
    argv: Sequence[str],
    *,
    timeout: float,
    input: str | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` without a shell, capture text output, never raise on exit status.

    Raises:
        FileNotFoundError: the program does not exist.
        subprocess.TimeoutExpired: it ran longer than ``timeout`` seconds (it is killed).
    """
    return subprocess.run(
        list(argv),
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=dict(env) if env is not None else None,
    )


class SlurmClient:
    """Runs Slurm client commands and reads their output.

    Args:
        runner: how to run a command; defaults to :func:`run_subprocess`.
        timeout_s: the limit for each command, in seconds.
        env: environment for the commands (e.g. with ``SLURM_CONF``); ``None`` inherits.
    """

    def __init__(
        self,
        *,
        runner: Runner | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self._runner: Runner = runner if runner is not None else run_subprocess
        self._timeout_s = timeout_s
        self._env = dict(env) if env is not None else None
        self._sacct_disabled = False

    # ------------------------------------------------------------------ running
    def run(
        self,
        argv: Sequence[str],
        *,
        input: str | None = None,
        timeout_s: float | None = None,
        extra_env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run one Slurm command; return it when it exits 0 (``extra_env``: variables
        added to the command's environment).

        Raises:
            SlurmCommandNotFoundError: ``argv[0]`` is not installed / not on PATH.
            SlurmControllerError: the output says slurmctld is unreachable.
            SlurmJobNotFoundError: the output says the job id is invalid.
            SlurmCommandError: any other non-zero exit, or the timeout passed.
        """
        argv = list(argv)
        timeout = self._timeout_s if timeout_s is None else timeout_s
        logger.debug("running %s (timeout %.0f s)", argv, timeout)
        try:
            env = self._env
            if extra_env:
                env = {**(os.environ if env is None else env), **extra_env}
            proc = self._runner(argv, timeout=timeout, input=input, env=env)
        except FileNotFoundError as exc:
            path = (self._env or os.environ).get("PATH", "")
            raise SlurmCommandNotFoundError(
                f"{argv[0]!r} was not found on PATH={path!r}; {_INSTALL_HINT}"
            ) from exc
        except subprocess.TimeoutExpired as exc:
            stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
            raise SlurmCommandError(
                f"{' '.join(argv)!r} did not finish within {timeout:.0f} s; is slurmctld "
                "overloaded or unreachable? ('scontrol ping'; raise timeout_s if it is slow)",
                argv,
                None,
                stderr,
            ) from exc
        if proc.returncode != 0:
            text = f"{proc.stderr}\n{proc.stdout}".strip()
            if is_controller_unreachable(text):
                raise SlurmControllerError(
                    f"{' '.join(argv)!r} could not reach the Slurm controller: {text!r}; "
                    "check SLURM_CONF and that slurmctld runs ('scontrol ping'; for the "
                    "local test cluster: 'scripts/slurm-cluster status')"
                )
            error = SlurmJobNotFoundError if is_invalid_job(text) else SlurmCommandError
            raise error(
                f"{' '.join(argv)!r} exited with status {proc.returncode}: {text!r}",
                argv,
                proc.returncode,
                proc.stderr,
            )
        return proc

    # ------------------------------------------------------------------ submitting
    def submit(
        self,
        script: str | os.PathLike[str],
        extra_args: Sequence[str] = (),
        *,
        cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> str:
        """Submit a batch script with ``sbatch --parsable``; return the job id.

        Args:
            script: the script's text (``str``, passed on stdin) or its path
                (``os.PathLike``, passed as an argument).
            extra_args: more sbatch options, e.g. ``["--array=0-3", "-N2"]``.
            cwd: the job's working directory (``--chdir``); default: sbatch's.
            env: variables added to sbatch's environment, which the job gets as sbatch's
                export rules say (all of it by default; ``SLURM_*`` names even with
                ``--export=NONE``).

        Raises:
            SlurmCommandError: sbatch rejected the job (the message has its reason).
        """
        argv = ["sbatch", "--parsable", *extra_args]
        if cwd is not None:
            argv.append(f"--chdir={os.fspath(cwd)}")
        if isinstance(script, str):
            proc = self.run(argv, input=script, extra_env=env)
        else:
            proc = self.run([*argv, os.fspath(script)], extra_env=env)
        job_id = parse_sbatch_parsable(proc.stdout)
        logger.info("submitted Slurm job %s", job_id)
        return job_id

    def cancel(
        self,
        job_ref: str,
        *,
        signal: str | None = None,
        batch: bool = False,
        full: bool = False,
        state: str | None = None,
    ) -> None:
        """``scancel`` a job, or send it a signal.

        Args:
            job_ref: ``"12"``, or ``"12_3"`` for one array task.
            signal: e.g. ``"USR2"``: only signal, do not cancel.
            batch: signal only the batch shell (``--batch``).
            full: signal the batch shell and all steps (``--full``).
            state: only act on tasks in this state (``--state=PENDING``: the queued
                tasks of an array, leaving the running ones alone).
        """
        argv = ["scancel"]
        if state is not None:
            argv.append(f"--state={state}")
        if signal is not None:
            argv.append(f"--signal={signal}")
        if batch:
            argv.append("--batch")
        if full:
            argv.append("--full")
        self.run([*argv, job_ref])

    def requeue(self, job_ref: str, *, hold: bool = False) -> None:
        """``scontrol requeue`` (or ``requeuehold``) one job or array task."""
        self.run(["scontrol", "requeuehold" if hold else "requeue", job_ref])
        logger.info("requeued Slurm job %s", job_ref)

    def release(self, job_ref: str) -> None:
        """``scontrol release``: let a held job run again."""
        self.run(["scontrol", "release", job_ref])

    def start_now(self, job_ref: str) -> None:
        """Set a pending job's earliest start (``BeginTime``) to now.

        Caution (verified on Slurm 22.05): a requeued job is held ``cred_expire`` seconds
        on purpose. Starting it earlier can place it on a node that still holds the
        revoked credential of its previous run; it then fails at once with "Job
        credential revoked" (state FAILED). Use this for jobs submitted with
        ``--begin``, not to hurry a requeue.
        """
        self.run(["scontrol", "update", f"JobId={job_ref}", "StartTime=now"])

    # ------------------------------------------------------------------ querying
    def job_infos(self, job_ref: str) -> list[JobInfo]:
        """All records Slurm has for ``job_ref`` (an array job: one per task).

        Raises:
            SlurmJobNotFoundError: neither sacct nor slurmctld knows the job.
        """
        if not self._sacct_disabled:
            try:
                proc = self.run(
                    [
                        "sacct",
                        "--parsable2",
                        "--noheader",
                        f"--format={SACCT_FORMAT}",
                        "--jobs",
                        job_ref,
                    ]
                )
                infos = parse_sacct(proc.stdout)
                if infos:
                    return infos
            except SlurmCommandError as exc:
                if not is_sacct_disabled(f"{exc.stderr}\n{exc}"):
                    raise
                logger.debug("sacct is disabled (no slurmdbd); using scontrol from now on")
                self._sacct_disabled = True
        proc = self.run(["scontrol", "show", "job", "--oneliner", job_ref])
        infos = [job_info_from_scontrol(r) for r in parse_scontrol_show_job(proc.stdout)]
        if not infos:
            raise SlurmJobNotFoundError(
                f"Slurm has no record of job {job_ref!r}", ["scontrol", "show", "job"], 0
            )
        return infos

    def job_info(self, job_ref: str) -> JobInfo:
        """The record for exactly ``job_ref`` (a plain job, or one array task ``12_3``).

        For an array's own id (``12``) this is the task whose id is ``12``; use
        :meth:`job_infos` for all tasks.
        """
        infos = self.job_infos(job_ref)
        for info in infos:
            if (info.ref if "_" in job_ref else info.job_id) == job_ref:
                return info
        raise SlurmJobNotFoundError(
            f"Slurm returned records for {job_ref!r} but none for exactly that job "
            f"(got {[i.ref for i in infos]})",
            ["scontrol", "show", "job", job_ref],
            0,
        )

    def job_state(self, job_ref: str) -> JobState:
        """The state of one job or one array task (see :meth:`job_info`)."""
        return self.job_info(job_ref).state

    def queue(self, extra_args: Sequence[str] = ()) -> list[JobInfo]:
        """Active jobs from ``squeue`` (one record per array task), filtered by extra_args."""
        proc = self.run(
            ["squeue", "--noheader", "--array", f"--format={SQUEUE_FORMAT}", *extra_args]
        )
        return parse_squeue(proc.stdout)

    def hostnames(self, hostlist: str) -> list[str]:
        """Expand a hostlist (``node[1-3]``) with ``scontrol show hostnames``.

        Raises:
            SlurmCommandError: Slurm calls the hostlist invalid (e.g. ``n[3-1]``; 22.05
                also rejects a suffix after the last bracket, ``gpu[1-2]x``).
        """
        argv = ["scontrol", "show", "hostnames", hostlist]
        proc = self.run(argv)
        if "invalid hostlist" in proc.stderr.lower():  # Slurm 22.05 still exits 0 here
            raise SlurmCommandError(
                f"Slurm rejects the hostlist {hostlist!r}: {proc.stderr.strip()!r}",
                argv,
                proc.returncode,
                proc.stderr,
            )
        return parse_hostnames(proc.stdout)

    # ------------------------------------------------------------------ the site
    def version(self) -> SlurmVersion:
        """The installed Slurm's version, from ``sbatch --version``.

        Raises:
            SlurmCommandNotFoundError: no sbatch here.
            SlurmControllerError: sbatch finds no configuration (22.05 reads it even for
                ``--version``: ``SLURM_CONF`` unset and no DNS SRV record).
            SlurmParseError: the output holds no version.
        """
        return parse_version(self.run(["sbatch", "--version"]).stdout)

    def site_config(self) -> dict[str, str]:
        """``scontrol show config`` as a mapping (``KillWait`` -> ``"30 sec"``)."""
        return parse_key_values(self.run(["scontrol", "show", "config"]).stdout)

    def partitions(self, name: str | None = None) -> list[PartitionInfo]:
        """``scontrol show partition --oneliner [NAME]``: every partition, or ``name``'s."""
        argv = ["scontrol", "show", "partition", "--oneliner"]
        return parse_partition(self.run([*argv, name] if name else argv).stdout)

    def ping(self) -> bool:
        """True when ``scontrol ping`` reports the controller UP (never raises on DOWN)."""
        try:
            proc = self.run(["scontrol", "ping"])
        except SlurmControllerError:
            return False
        except SlurmCommandError as exc:
            logger.debug("scontrol ping failed: %s", exc)
            return False
        return " is UP" in proc.stdout

    def check(self) -> None:
        """Raise unless the client tools exist and the controller answers.

        Raises:
            SlurmCommandNotFoundError: ``scontrol`` is not installed.
            SlurmControllerError: slurmctld does not answer ``scontrol ping``.
        """
        if shutil.which("scontrol", path=(self._env or os.environ).get("PATH")) is None:
            raise SlurmCommandNotFoundError(f"'scontrol' was not found on PATH; {_INSTALL_HINT}")
        if not self.ping():
            conf = (self._env or os.environ).get("SLURM_CONF", "(unset)")
            raise SlurmControllerError(
                f"slurmctld does not answer 'scontrol ping' (SLURM_CONF={conf}); start it, "
                "or for the local test cluster run 'scripts/slurm-cluster up' and source its env"
            )
